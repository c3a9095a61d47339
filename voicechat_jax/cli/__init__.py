"""The command-line entry points, each a short absl app: ``serve`` (voicechat-serve) and
``convert`` (voicechat-convert). The library never defines flags; only these modules do, and each
runs as its own process."""
