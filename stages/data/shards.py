"""`datasets` folders written and read one record batch at a time, with plain file I/O.

A `datasets` folder (what `save_to_disk` writes and `load_from_disk` reads) is a list of Arrow IPC
stream files ("shards") and two small JSON files. Writing the shards directly lets every worker
process write its own while it works, with no copy at the end; reading them with plain reads instead
of a memory map keeps a reader's resident memory at one batch (the pages of a memory map count in
the process's RSS for as long as they stay mapped, so a pass over a mapped 10 GB folder "uses" 10 GB).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

# Column kinds as `datasets` describes them (its `Features.to_dict()`) and as Arrow types. Written
# out here so that worker processes need not import `datasets` (a second of start-up each).
_STRING = {"dtype": "string", "_type": "Value"}
_IDS = {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"}
TEXT = {"text": _STRING}
DOCUMENTS = {"text": _STRING, "title": _STRING, "label": _STRING}
TOKENS = {"input_ids": _IDS}


def _arrow_type(kind: dict[str, Any]) -> Any:
    import pyarrow as pa

    return pa.list_(pa.int32()) if kind == _IDS else pa.string()


class ShardWriter:
    """One Arrow stream file with columns `features` (one of TEXT, DOCUMENTS, TOKENS), appended to
    batch by batch."""

    def __init__(self, path: Path, features: dict[str, Any]):
        import pyarrow as pa

        self.path = path
        self.rows = 0
        metadata = {"huggingface": json.dumps({"info": {"features": features}})}
        self.schema = pa.schema([pa.field(n, _arrow_type(k)) for n, k in features.items()], metadata=metadata)
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)

    def write(self, columns: dict[str, Any]) -> None:
        import pyarrow as pa

        arrays = [c if isinstance(c := columns[f.name], pa.Array) else pa.array(c, type=f.type) for f in self.schema]
        batch = pa.record_batch(arrays, schema=self.schema)
        if batch.num_rows:
            self._writer.write_batch(batch)
            self.rows += batch.num_rows

    def close(self) -> None:
        self._writer.close()
        self._sink.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def finish_folder(folder: Path, shards: list[str], features: dict[str, Any]) -> None:
    """Write the JSON files that make `folder`, holding `shards` (in this order), a `datasets`
    folder that `datasets.load_from_disk` opens."""
    fingerprint = hashlib.blake2b(json.dumps(shards).encode(), digest_size=8)
    for shard in shards:
        fingerprint.update(str((folder / shard).stat().st_size).encode())
    state = {
        "_data_files": [{"filename": shard} for shard in shards],
        "_fingerprint": fingerprint.hexdigest(),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))


def shard_files(folder: Path) -> list[Path]:
    """The shards of a `datasets` folder, in row order."""
    state = json.loads((folder / "state.json").read_text())
    return [folder / entry["filename"] for entry in state["_data_files"]]


def read_batches_located(path: Path) -> Iterator[tuple[Any, int]]:
    """The record batches of one shard, read into memory one at a time, each with the number to add
    to one of its buffers' `address` for that buffer's byte offset in the file: a stream file holds
    each batch's buffers as they are in memory, so the file can be memory-mapped and read in place."""
    import pyarrow as pa

    with pa.OSFile(str(path)) as source:
        messages = pa.ipc.MessageReader.open_stream(source)
        schema = pa.ipc.read_schema(messages.read_next_message())
        for message in messages:
            body_at = source.tell() - message.body.size  # a message ends with its body
            yield pa.ipc.read_record_batch(message, schema), body_at - message.body.address


def read_batches(path: Path, columns: tuple[str, ...] | None = None) -> Iterator[Any]:
    """The record batches of one shard (an Arrow stream file), read into memory one at a time."""
    import pyarrow as pa

    with pa.OSFile(str(path)) as source:
        reader = pa.ipc.open_stream(source)
        for batch in reader:
            yield batch if columns is None else batch.select(list(columns))
