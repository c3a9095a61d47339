r"""voicechat-convert: NVIDIA's public release -> an orbax checkpoint, streaming and strict.

  voicechat-convert --src=NVIDIA-NemotronLabs-VoiceChat-11B --dst=checkpoints/voicechat_11b \
      --tokenizer=NVIDIA-Nemotron-Nano-9B-v2/tokenizer.json

What is checked and how memory stays bounded: ``voicechat_jax.convert``. SIGTERM, like SIGINT,
becomes ``convert.Interrupted``, which removes the partial directory.

  voicechat-convert --check=checkpoints/voicechat_11b [--verify=sizes]

verifies a converted checkpoint (``checkpoint.check``) without loading it. Every failure is one
line on stderr, ``voicechat-convert: <what went wrong>``, and a non-zero exit: 2 for bad flags,
128 + N after signal N, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import typing
from collections.abc import Iterator


def _stop_before_start(signum: int, frame) -> None:
    """SIGINT / SIGTERM while the modules load or the flags are read: nothing is written yet, so
    exit at once. Installed before JAX is imported: the default KeyboardInterrupt would be lost if
    it landed in JAX's garbage-collection callback (printed as ignored, the conversion going on),
    and a process started in the background of a script inherits SIGINT ignored."""
    name = signal.Signals(signum).name
    os.write(2, f"voicechat-convert: interrupted by {name}; nothing was written\n".encode())
    os._exit(128 + signum)


if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "voicechat-convert":
    for _signum in (signal.SIGINT, signal.SIGTERM):  # the program only, not an importer
        signal.signal(_signum, _stop_before_start)

from absl import app, flags, logging  # noqa: E402

from voicechat_jax import checkpoint as ckpt  # noqa: E402
from voicechat_jax.cli import flag_parsing  # noqa: E402
from voicechat_jax.convert import SHARD_BYTES, ConversionError, Interrupted, convert  # noqa: E402
from voicechat_jax.precision import Precision  # noqa: E402

FLAGS = flags.FlagValues()  # this app's own flags (cli.flag_parsing)
flags.DEFINE_string(
    "src", None, "The release directory: config.json + model.safetensors.", flag_values=FLAGS
)
flags.DEFINE_string("dst", None, "Where the checkpoint goes (must not exist).", flag_values=FLAGS)
flags.DEFINE_string(
    "tokenizer", None, "The text tokenizer's tokenizer.json (or its folder).", flag_values=FLAGS
)
flags.DEFINE_string(
    "llm_config", None, "The LLM's config.json (default: built-in Nano 9B v2).", flag_values=FLAGS
)
flags.DEFINE_string(
    "revision", None, "The release revision, recorded in the manifest.", flag_values=FLAGS
)
flags.DEFINE_enum(
    "precision", "reference", ["reference", "fp32"], "Dtype policy written.", flag_values=FLAGS
)
flags.DEFINE_bool(
    "text_table", True, "Precompute the text table (needs --tokenizer).", flag_values=FLAGS
)
flags.DEFINE_bool(
    "dry_run",
    False,
    "Print the mapping and what would be written; read headers.",
    flag_values=FLAGS,
)
flags.DEFINE_integer(
    "shard_bytes",
    SHARD_BYTES,
    "Host memory per written shard (bytes).",
    lower_bound=1,
    flag_values=FLAGS,
)
flags.DEFINE_string(
    "check",
    None,
    "Verify this converted checkpoint instead of converting (no --src/--dst).",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "verify",
    "full",
    [v.value for v in ckpt.Verify],
    "With --check: full (sizes and sha256 of every file) or sizes (stat only).",
    flag_values=FLAGS,
)


flags.DEFINE_string(
    "manifest_sha256",
    None,
    "With --check: the sha256 the checkpoint's integrity.json must have (printed when it was "
    "written), pinning every file it lists (integrity.json alone guards against damage, not "
    "tampering).",
    flag_values=FLAGS,
)


@flags.multi_flags_validator(
    ["src", "dst", "dry_run", "check", "manifest_sha256"], flag_values=FLAGS
)
def _flags_agree(values: dict) -> bool:
    if values["manifest_sha256"] and not values["check"]:
        raise flags.ValidationError("--manifest_sha256 goes with --check")
    if values["check"]:
        if values["src"] or values["dst"] or values["dry_run"]:
            raise flags.ValidationError("--check takes no --src, --dst or --dry_run")
    elif not values["src"] or not (values["dst"] or values["dry_run"]):
        raise flags.ValidationError("--src and --dst are required (--dst not with --dry_run)")
    return True


class _ProgressBar:
    """A tqdm bar on stderr, shown from the first progress on; ``close`` ends its line (so that
    an error prints on a line of its own)."""

    def __init__(self, tqdm):
        self.tqdm, self.bar = tqdm, None

    @classmethod
    def make(cls) -> _ProgressBar | None:
        try:
            from tqdm import tqdm
        except ImportError:
            return None  # the library logs percentages instead
        return cls(tqdm)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = self.tqdm(
                total=total, unit="B", unit_scale=True, desc="converting", file=sys.stderr
            )
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fail(message: str, status: int = 1) -> typing.NoReturn:
    """Exits with ``message`` as one line on stderr."""
    print("voicechat-convert: " + " ".join(message.split()), file=sys.stderr, flush=True)
    sys.exit(status)


class Signals:
    """SIGINT and SIGTERM as ``Interrupted``: raised at once, or at the end of ``held()``.

    The CLI installs one for the whole conversion and passes ``held`` to ``convert`` as
    ``uninterrupted``. After the first signal both go back to their default: a second one while
    the partial directory is being removed ends the process at once (the next conversion to the
    same ``--dst`` removes what is left).

    A signal is also kept (``received``) and raised again by ``poll`` (called on every bit of
    progress and around every save): an exception raised by a signal handler is lost when it lands
    in a callback that Python runs for the interpreter (JAX's garbage-collection callback), and
    the conversion would go on to the end.
    """

    def __init__(self):
        self._depth, self._pending = 0, None
        self.received: int | None = None
        self._saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in self._saved:
            signal.signal(signum, self._handle)

    def close(self) -> None:
        """The handlers as they were (``main`` called in a process that goes on, a test's)."""
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.received = signum
        if self._depth:
            self._pending = signum
            return
        raise Interrupted(signum)

    def poll(self) -> None:
        """Raises ``Interrupted`` when a signal came (outside ``held``)."""
        if self.received is not None and not self._depth:
            raise Interrupted(self.received)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals arriving inside are raised when it ends."""
        self.poll()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None:
                signum, self._pending = self._pending, None
                raise Interrupted(signum)
            self.poll()


def _check(directory: str, verify: ckpt.Verify, manifest_sha256: str | None) -> None:
    try:
        done = ckpt.check(directory, verify, manifest_sha256=manifest_sha256)
    except Interrupted as e:
        _fail(str(e), 128 + e.signum)
    except ckpt.CheckpointError as e:
        _fail(str(e))
    print(
        f"{done.directory}: {done.files} files, {done.bytes:,} bytes verified ({done.verify}) "
        f"in {done.seconds:.2f} s"
    )


def main(argv: list[str]) -> None:
    """The app on parsed flags; a failure exits (``SystemExit``) with its one line on stderr."""
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]} {_FLAGS_HINT}", 2)
    signals = Signals()
    try:
        _main(signals)
    finally:
        signals.close()


def _main(signals: Signals) -> None:
    if FLAGS.check:
        _check(FLAGS.check, ckpt.Verify(FLAGS.verify), FLAGS.manifest_sha256)
        return
    existed = bool(FLAGS.dst) and os.path.lexists(FLAGS.dst)
    precision = Precision.fp32() if FLAGS.precision == "fp32" else Precision.reference()
    logging.info("converting %s -> %s (%s)", FLAGS.src, FLAGS.dst, precision)
    bar = None if FLAGS.dry_run else _ProgressBar.make()

    def progress(done: int, total: int) -> None:
        signals.poll()
        if bar is not None:
            bar(done, total)

    try:
        try:
            result = convert(
                FLAGS.src,
                FLAGS.dst,
                tokenizer=FLAGS.tokenizer,
                llm_config=FLAGS.llm_config,
                dry_run=FLAGS.dry_run,
                precision=precision,
                progress=None if FLAGS.dry_run else progress,
                revision=FLAGS.revision,
                text_table=FLAGS.text_table,
                shard_bytes=FLAGS.shard_bytes,
                uninterrupted=signals.held,
            )
        finally:
            if bar is not None:
                bar.close()
    except Interrupted as e:
        if not FLAGS.dry_run and not existed and os.path.lexists(FLAGS.dst):  # after the rename
            _fail(f"{e} after {FLAGS.dst} was written whole", 128 + e.signum)
        _fail(
            f"{e}" + ("" if FLAGS.dry_run else f"; nothing was written to {FLAGS.dst}"),
            128 + e.signum,
        )
    except (ConversionError, OSError) as e:
        _fail(str(e))
    except Exception as e:  # a bug: still one line, the traceback at --verbosity=1
        logging.debug("the conversion failed", exc_info=True)
        _fail(f"{type(e).__name__}: {e} (--verbosity=1 logs the traceback)")
    if FLAGS.dry_run:
        print(result.listing)
        return
    digest = ckpt.integrity_digest(result.dst)
    print(
        f"wrote {result.dst} in {result.seconds:.0f} s; its integrity.json has sha256 {digest} "
        "(keep it apart and pass --manifest_sha256 to trust nothing else)"
    )


_FLAGS_HINT = "(--helpshort lists the flags)"


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, each error as one line (absl's own prints two)."""
    try:
        return flag_parsing.parse(FLAGS, argv, __doc__)
    except flags.Error as e:
        _fail(f"{e} {_FLAGS_HINT}", 2)


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
