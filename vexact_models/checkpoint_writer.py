"""Writing a new checkpoint folder from an existing one, tensor by tensor (`vexact export-text`,
`vexact dequantize-fp8`): safetensors shards
named and indexed as ``save_pretrained`` writes them (`ShardWriter`), the source's other files
copied (`copy_side_files`), and the whole written beside the target and renamed into place at the
end (`staged_folder`), so that a failed or interrupted write (SIGTERM included) leaves nothing at
the target, nor the folders made for it. A target the rename cannot take (a symbolic link, the
current folder, under a file or a folder not writable) is refused up front (`check_target`)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

__all__ = ["DEFAULT_SHARD_SIZE", "ShardWriter", "check_target", "copy_side_files", "make_parents", "new_folder",
           "remove_empty", "shard_bytes", "staged_folder", "unwritable"]

DEFAULT_SHARD_SIZE = "5GB"
#: the files of a checkpoint folder that are its weights (rewritten, never copied)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def shard_bytes(max_shard_size: int | str, who: str) -> int:
    """``max_shard_size`` (bytes, as an int or digits, or a size such as "5GB") in bytes; a
    ValueError from `who` otherwise."""
    digits = isinstance(max_shard_size, str) and max_shard_size.strip().isdecimal()
    try:  # (transformers takes bytes only as an int)
        size = convert_file_size_to_int(int(max_shard_size) if digits else max_shard_size)
    except (ValueError, TypeError):
        size = None
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{who}: max_shard_size={max_shard_size!r} must be a positive number of bytes or a size "
                         "such as '5GB'")
    return size


def unwritable(folder: Path) -> str | None:
    """Why `folder` (existing or not) cannot be made or written in, or None: the nearest existing
    path on its way is not a folder, or is one this process may not write in."""
    nearest = Path(folder).absolute()
    while not os.path.lexists(nearest):
        nearest = nearest.parent
    if not nearest.is_dir():
        return f"{str(nearest)!r} is not a folder"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"no permission to write in {str(nearest)!r}"
    return None


def check_target(target: Path, who: str) -> None:
    """A ValueError from `who`, naming `target` and why, unless `target` is a folder that
    `staged_folder` can write and rename into place: not existing or an empty folder, not a
    symbolic link, not the current folder (or one above it), in a folder that can be made and
    written in."""
    where = f"{who}: target {str(target)!r}"
    if target.is_symlink():
        raise ValueError(f"{where} is a symbolic link; name the folder to write itself (new, or empty)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{where} exists and is not an empty folder; it writes a new folder and never overwrites")
    if target.name in ("", ".", "..") or Path.cwd().resolve().is_relative_to(target.resolve()):
        raise ValueError(f"{where} is the current folder or one above it; name a new folder (it is written beside, "
                         "then renamed into place)")
    problem = unwritable(target.parent)
    if problem:
        raise ValueError(f"{where} cannot be made: {problem}")


def new_folder(parent: Path, prefix: str) -> Path:
    """A new folder in `parent` named `prefix` and a random suffix, with the mode a plain mkdir
    gives (0o777 less the umask, as ``save_pretrained``'s folder; ``tempfile.mkdtemp``'s is 0o700)."""
    while True:
        folder = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def make_parents(folder: Path) -> list[Path]:
    """Make `folder` and its missing parents; the folders it made, deepest first (for
    `remove_empty`). An OSError leaves none of them behind."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for path in reversed(missing):
            path.mkdir()
            made.insert(0, path)
    except OSError:
        remove_empty(made)
        raise
    return made


def remove_empty(folders: list[Path]) -> None:
    """Remove each of `folders` (deepest first) that is empty; leave the others."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def staged_folder(target: Path, who: str) -> Iterator[Path]:
    """A new folder beside `target` to write into, renamed to `target` when the block ends without
    an error; removed otherwise, with the parents it made, SIGTERM included (`_sigterm_exits`). A
    ValueError from `who`, before anything is made, for a `target` `check_target` refuses or
    whose folder cannot be made."""
    check_target(target, who)
    with _sigterm_exits():
        made: list[Path] = []
        try:
            made = make_parents(target.parent)
            staging = new_folder(target.parent, f".{target.name}.")
        except OSError as error:
            remove_empty(made)
            raise ValueError(f"{who}: target {str(target)!r} cannot be made: {error}") from None
        try:
            yield staging
            if target.exists():
                target.rmdir()  # empty (checked above)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            remove_empty(made)
            raise


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM (how SLURM, Kubernetes or systemd stop a job) raises SystemExit(143) while the block
    runs, so that `staged_folder` removes what it wrote; only from the main thread (the one that
    may set handlers) and where SIGTERM has its default action (a handler or SIG_IGN set by the
    program stays). The handler before is restored after."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_on_sigterm(signum: int, frame) -> None:
    """`_sigterm_exits`' handler: unwind, as an exception does."""
    raise SystemExit(128 + signum)  # (the status a shell gives a process SIGTERM ended)


def copy_side_files(source: Path, folder: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy the files of `source` that are not its weights, its ``config.json`` or in `skip`
    (tokenizer, generation config, chat template, ...) into `folder`."""
    for file in sorted(source.iterdir()):
        copied = file.name not in (*WEIGHT_FILES, "config.json", *skip) and not file.name.endswith(".safetensors")
        if file.is_file() and copied:
            shutil.copy2(file, folder / file.name)


class ShardWriter:
    """Tensors into safetensors files of at most `limit` bytes each (a larger tensor alone in its
    file), written as each fills, so memory holds one shard at a time; named and indexed as
    ``save_pretrained`` names them (``model.safetensors``, or ``model-00001-of-0000N.safetensors``
    and ``model.safetensors.index.json``) by `finish`."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes)

    def add(self, name: str, tensor) -> None:
        """Queue tensor `name` (written when its shard is full, or by `finish`)."""
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        if not self.pending:
            return
        file = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        self.written.append((file, sorted(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Write what is pending and give the files their final names (and the index)."""
        self._flush()
        if len(self.written) == 1:
            os.replace(self.folder / self.written[0][0], self.folder / "model.safetensors")
            return
        weight_map = {}
        for number, (file, names, _) in enumerate(self.written, start=1):
            final = f"model-{number:05d}-of-{len(self.written):05d}.safetensors"
            os.replace(self.folder / file, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": sum(size for _, _, size in self.written)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
