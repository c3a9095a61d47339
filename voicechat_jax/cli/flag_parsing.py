"""How the command-line apps parse their flags: each app's own ``FlagValues``, then absl's.

Each app (``serve``, ``convert``, ``load``) defines its flags on a ``FlagValues`` of its own, not
on absl's global one: the apps share flag names (``--seconds``, ``--precision``, ...), so on the
global object two of them could not be imported into one process, and their flag tests could not
run in the test process (a fresh parse of the app's own object is all a test needs). absl's own
flags (logging's ``--verbosity``, ``--logtostderr``, ...) stay global and are parsed after the
app's; a flag neither knows is refused there, with absl's usual message.

``--help`` (``-h``, ``-?``, ``--helpshort``) prints the app's usage and every one of its flags with
its help and exits 0; ``--helpfull`` adds absl's.
"""

from __future__ import annotations

import sys
import textwrap

from absl import flags

HELP = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull")


def usage(own: flags.FlagValues, doc: str, *, full: bool = False) -> str:
    """The app's usage text: its docstring, then its flags (absl's too with ``full``)."""
    text = [textwrap.dedent(doc).strip(), "", "flags:", _flag_help(own)]
    if full:
        text += ["", "absl flags:", _flag_help(flags.FLAGS)]
    return "\n".join(text) + "\n"


def _flag_help(values: flags.FlagValues) -> str:
    """absl's help text for ``values`` without its per-module headings (each a module's file
    path, indented less than the flags under it)."""
    lines = values.get_help(prefix="  ").splitlines()
    return "\n".join(x for x in lines if x.startswith("    "))


def parse(own: flags.FlagValues, argv: list[str], doc: str) -> list[str]:
    """Parses ``argv`` into ``own`` (validators included), then absl's global flags; returns the
    arguments that are not flags (``argv[0]`` first).

    Raises:
      flags.Error: a bad value, a failed validator or an unknown flag (the caller prints it).
      SystemExit(0): after printing the usage, for a help flag.
    """
    own.unparse_flags()  # every flag from its default, however often a process parses
    asked = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in HELP]
    if asked:
        sys.stdout.write(usage(own, doc, full=any("full" in a for a in asked)))
        sys.stdout.flush()
        raise SystemExit(0)
    return flags.FLAGS(own(argv, known_only=True))
