"""The file formats ``storaged save`` and ``restore`` know, by name and by suffix, and the
errors about files: what a command line needs before it reads a file (``format_of``), so
that parsing it, and the commands that read no file, import no numpy
(``storaged.client.formats`` reads and writes the files).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

#: Format names ``--format`` accepts, and the file suffixes that imply them.
FORMATS: Final = ("safetensors", "npz", "torch", "raw")
SUFFIXES: Final[Mapping[str, str]] = {
    ".safetensors": "safetensors",
    ".npz": "npz",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",  # pytorch_model.bin
}
#: Formats that can be read from stdin / written to stdout (``-``).
SAVE_FROM_STDIN: Final = ("raw",)
RESTORE_TO_STDOUT: Final = ("safetensors", "npz", "raw")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class FormatError(ValueError):
    """A file that cannot be read or written as asked; the message names it and says why."""


class UnknownFormat(FormatError):
    """The format is not given and the file name does not say it."""


class MissingLibrary(FormatError):
    """The format needs a package that is not installed."""


def clean_message(text: str) -> str:
    """``text`` without terminal colour codes, on one line."""
    return " ".join(_ANSI.sub("", text).split())


def format_of(path: str, given: str | None) -> str:
    """The format of ``path`` (``-`` is stdin/stdout): ``given``, else its suffix, else a
    directory of safetensors shards. ``UnknownFormat`` says what to pass instead."""
    if given is not None:
        return given
    if path == "-":
        raise UnknownFormat("- (stdin/stdout) has no extension: pass --format")
    p = Path(path)
    fmt = SUFFIXES.get(p.suffix.lower())
    if fmt is not None:
        return fmt
    if p.is_dir() or path.endswith("/"):
        return "safetensors"  # a directory of shards
    known = ", ".join(SUFFIXES)
    raise UnknownFormat(
        f"{path}: unknown file type {p.suffix or '(none)'}; expected {known}, "
        "a directory of .safetensors shards, or --format"
    )
