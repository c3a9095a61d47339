"""Pallas kernels of the serving hot path, each beside its plain-jnp reference.

Every ``<op>.py`` exports ``<op>(..., interpret=False)`` and ``<op>_reference(...)``; the model
reaches a kernel only through its ``ServeConfig`` switch, and the jnp path always exists.
"""
