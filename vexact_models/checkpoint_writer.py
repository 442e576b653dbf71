"""Writing a new checkpoint folder from an existing one, tensor by tensor (`vexact export-text`,
`vexact dequantize-fp8`): safetensors shards
named and indexed as ``save_pretrained`` writes them (`ShardWriter`), the source's other files
copied (`copy_side_files`), and the whole written beside the target and renamed into place at the
end (`staged_folder`), so that a failed or interrupted write leaves nothing at the target."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

__all__ = ["DEFAULT_SHARD_SIZE", "ShardWriter", "copy_side_files", "shard_bytes", "staged_folder"]

DEFAULT_SHARD_SIZE = "5GB"
#: the files of a checkpoint folder that are its weights (rewritten, never copied)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def shard_bytes(max_shard_size: int | str, who: str) -> int:
    """``max_shard_size`` (bytes, or a size such as "5GB") in bytes; a ValueError from `who` otherwise."""
    try:
        size = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError):
        size = None
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{who}: max_shard_size={max_shard_size!r} must be a positive number of bytes or a size "
                         "such as '5GB'")
    return size


@contextlib.contextmanager
def staged_folder(target: Path, who: str) -> Iterator[Path]:
    """A new folder beside `target` to write into, renamed to `target` when the block ends without
    an error (removed otherwise). A ValueError from `who`, before anything is made, when `target`
    exists and is not an empty folder."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{who}: target {str(target)!r} exists and is not an empty folder; it writes a new folder "
                         "and never overwrites")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        if target.exists():
            target.rmdir()  # empty (checked above)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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
