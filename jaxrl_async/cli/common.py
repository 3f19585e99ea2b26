"""What every command-line tool of the package shares: one error style, argument parsing that shows
defaults, and the checks of user-given paths and model directories.

Error style. A user mistake (a missing or unreadable path, a model directory without config.json or
with truncated weights, a malformed input row, a bad flag value) ends the command with ONE line on
stderr that names the file, row or field, and exit status 2, no traceback::

    generate: error: --model runs/x/hf: not a directory
    score: error: in.jsonl: row 3: field 'completion_ids' must be a list of integers

Code raises :class:`UserError` for such mistakes (or one of the package's typed input errors listed
in ``_USER_ERROR_TYPES``: config errors, malformed safetensors, dataset rows, ...), and the tool's
``main`` is wrapped by :func:`cli_main`, which prints the line and returns 2. Anything else is an
internal error: it keeps its traceback (exit status 1). argparse's own errors (unknown flag, bad
type, ``parser.error``) exit 2 with the usage and a last line ``PROG: error: ...``. Ctrl-C ends a
tool with one line and exit status 130 (the RL run handles its signals itself).

Row numbers are 1-based line numbers of the file everywhere: ``row 2`` is line 2.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, Iterator

from jaxrl_async.data.tokenizer import (  # noqa: F401  (the tools import them from here)
    TOKENIZER_FILES, chat_template_wanted, generation_eos_ids, has_tokenizer_files,
)

# (module, class): the package's typed errors about user input; checked through sys.modules, so this
# module imports none of them (a class whose module was never imported cannot have been raised).
_USER_ERROR_TYPES = (
    ("jaxrl_async.checkpoint.hf_export", "ExportError"),
    ("jaxrl_async.data.tokenizer", "TokenizerFilesError"),
    ("jaxrl_async.config", "ConfigError"),
    ("jaxrl_async.models.safetensors_io", "SafetensorsError"),
    ("jaxrl_async.models.hf_io", "CheckpointMismatchError"),
    ("jaxrl_async.models.config", "UnsupportedModelError"),
    ("jaxrl_async.data.datasets", "DataFormatError"),
    ("jaxrl_async.cli.jsonl", "BadRowError"),
    ("jaxrl_async.generator.factory", "EngineSizingError"),
)

class UserError(Exception):
    """A mistake of the user (path, file content, flag value): one line ``TOOL: error: MESSAGE``, exit 2.
    The message names the file / row / field / flag."""


def is_user_error(e: BaseException) -> bool:
    if isinstance(e, UserError):
        return True
    for module, name in _USER_ERROR_TYPES:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return True
    return False


def error_line(tool: str, e: BaseException) -> str:
    """The one line printed for a user error (never more than one line)."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if msg.startswith("config error:"):  # ConfigError names itself
        return f"{tool}: {msg}"
    return f"{tool}: error: {msg}"


#: why a CPU run computes in float32 (issue 31: bfloat16 decode 1.6 vs 6.8 tokens/s on a Qwen3-0.6B shape, 2 cores)
CPU_BFLOAT16_WHY = ("bfloat16 matmuls are emulated on CPUs and run ~4x slower than float32 (decode 1.6 vs 6.8 "
                    "tokens/s measured on a Qwen3-0.6B shape)")


def note_cpu_bfloat16(tool: str, setting: str, dtype: str) -> bool:
    """One note line when ``setting`` (e.g. ``--dtype bfloat16``) asks for bfloat16 compute on a CPU-only JAX
    (starts JAX's backend)."""
    if dtype != "bfloat16":
        return False
    import jax

    if jax.default_backend() != "cpu":
        return False
    note(tool, f"{setting} on a CPU: {CPU_BFLOAT16_WHY}; float32 is faster here")
    return True


def note(tool: str, message: str) -> None:
    """A one-line remark on stderr (not an error)."""
    print(f"{tool}: note: {message}", file=sys.stderr, flush=True)


def cli_main(tool: str, *, handle_interrupt: bool = True) -> Callable:
    """Decorator for a tool's ``main(argv) -> int``: user errors -> one line on stderr and return 2;
    KeyboardInterrupt -> one line and return 130 (unless ``handle_interrupt=False``); other exceptions
    propagate with their traceback; SystemExit (argparse) passes through."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                if not handle_interrupt:
                    raise
                print(f"{tool}: interrupted", file=sys.stderr, flush=True)
                return 130
            except Exception as e:  # noqa: BLE001 - re-raised unless it is a user error
                if not is_user_error(e):
                    raise
                sys.stdout.flush()
                print(error_line(tool, e), file=sys.stderr, flush=True)
                return 2

        return run

    return wrap


# ---------------------------------------------------------------------------------------------
# argparse
# ---------------------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and appends ``(default: X)`` to every option whose default is
    not None/False (flags and "no default" options say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if ("%(default)" in help or default is None or default is False or default is argparse.SUPPRESS
                or default == [] or action.required or not action.option_strings):
            return help
        return help + " (default: %(default)s)"


def make_parser(prog: str, description: str | None = None, **kw: Any) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kw)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------
def require_file(flag: str, path: str) -> str:
    """``path`` is a readable regular file, else UserError naming ``flag`` and ``path``."""
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: file not found")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise UserError(f"{flag} {path}: not readable (permission denied)")
    return path


def require_output_file(flag: str, path: str) -> str:
    """``path`` can be written: its directory exists and ``path`` is not a directory. Checked before any
    work, so that a long generation never fails at its very end."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a directory, expected a file")
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable (permission denied)")
    return path


def iter_lines(flag: str, path: str) -> Iterator[str]:
    """The lines of a UTF-8 text file (UserError naming the file when it is missing or not text)."""
    require_file(flag, path)
    n = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, start=1):  # noqa: B007 (n: the row an error names)
                yield line
    except UnicodeDecodeError:
        raise UserError(f"{flag} {path}: not UTF-8 text (after row {n})") from None
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------
# Model directories
# ---------------------------------------------------------------------------------------------
def check_model_dir(flag: str, path: str) -> str:
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: not found (expected a Hugging Face model directory)")
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: not a directory (expected a Hugging Face model directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{flag} {path}: no config.json (expected a Hugging Face model directory)")
    return path


def model_config(flag: str, path: str, *, check_weights: bool = True, **policy: Any) -> Any:
    """``models.ModelConfig`` of a model directory; UserError naming the directory on any problem of its
    config.json (missing, not JSON, unsupported architecture, missing field) and, with ``check_weights``,
    of its safetensors files as far as their headers tell (missing, truncated, corrupt header, tensors
    that do not match config.json): no tensor is read, so a tool can fail fast before it loads anything."""
    check_model_dir(flag, path)
    from jaxrl_async.models.hf_io import config_from_hf

    try:
        cfg = config_from_hf(path, **policy)  # a Qwen2.5-VL directory: its VLConfig
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{flag} {path}: {e}") from None
    if check_weights:
        from jaxrl_async.models.hf_io import CheckpointMismatchError, check_checkpoint
        from jaxrl_async.models.safetensors_io import SafetensorsError, SafetensorsReader

        try:
            check_checkpoint(SafetensorsReader.from_dir(path), cfg, path)
        except (OSError, SafetensorsError, CheckpointMismatchError) as e:
            raise UserError(f"{flag} {path}: cannot load the weights: {e}") from None
    return cfg


def load_model(flag: str, path: str, cfg: Any = None, **policy: Any) -> tuple[Any, Any]:
    """``models.load_hf`` with every problem of the directory's files (no weights, truncated or corrupt
    safetensors, tensors that do not match config.json) as a UserError naming the directory."""
    from jaxrl_async.models import load_hf
    from jaxrl_async.models.hf_io import CheckpointMismatchError
    from jaxrl_async.models.safetensors_io import SafetensorsError

    if cfg is None:
        cfg = model_config(flag, path, **policy)
        policy = {}
    try:
        return load_hf(path, cfg=cfg, **policy)
    except (OSError, SafetensorsError, CheckpointMismatchError) as e:
        raise UserError(f"{flag} {path}: cannot load the weights: {e}") from None


def load_tokenizer(flag: str, path: str) -> Any:
    """The directory's tokenizer, or None when it has no tokenizer files (a weights + config directory).
    UserError when the files are there but do not load."""
    if not has_tokenizer_files(path):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - any loading failure of user files
        raise UserError(f"{flag} {path}: cannot load its tokenizer ({type(e).__name__}: {' '.join(str(e).split())})"
                        ) from None


