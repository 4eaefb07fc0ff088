"""Pack alone on synthetic token ids: wall and CPU seconds, tokens per second and per CPU second, peak
RssAnon and RSS (sampled from /proc/self/status every 0.1 s), and the sha256 of `train.npy` / `val.npy`
(equal across code versions: pack's bytes must not move).

    python bench/pack_synthetic.py [--tokens 200000000] [--documents N] [--repeat 2] [--against SRC] [--dir D] [--cold]

The tokens are documents of 20-500 random ids below 8,192 (with `--documents`, lengths drawn uniformly
around tokens / documents, so that the count of documents is N too) in `datasets` shards of 20,000
documents, tokenize's format, in a temporary folder (under `--dir`) removed after. Each pack runs in a
fresh process, after its imports (the stage's own figure). `--against SRC` (repeatable): a folder holding another
checkout's packages as `SRC/cram/{model,pipeline,stages}` (e.g. made with `git archive`), run
interleaved with this tree (this, SRC, this, SRC, ...): CPU time, which other load disturbs far less
than wall time on a shared machine, is the figure to compare. Each pack starts with the earlier ones'
writes on disk (a `sync`), so that their write-back does not land in it, and with the shards read into
the page cache, as right after tokenize. `--cold`: the shards are dropped from the page cache instead,
so that pack reads them from disk, as after tokenizing 10 GB on a small machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--documents", type=int, help="documents in all (default: lengths of 20-500)")
    parser.add_argument("--against", type=Path, action="append", default=[], help="repeatable")
    parser.add_argument("--dir", type=Path, help="where the temporary folder goes")
    parser.add_argument(
        "--cold", action="store_true", help="drop the token shards from the page cache before each pack"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(Path(args.child[0]), Path(args.child[1]))
        return
    with tempfile.TemporaryDirectory(prefix="cram-bench-pack-", dir=args.dir) as tmp:
        _write_tokens(Path(tmp) / "tokenize", args.tokens, args.documents)
        print(f"{os.cpu_count()} cores, load {_load()}", flush=True)
        print(
            "| code | wall s | CPU s (user + system) | M tokens/s | M tokens per CPU s | peak RssAnon MB | peak RSS MB "
            "| train.npy, val.npy sha256 | load |"
        )
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        for _ in range(args.repeat):
            for name, source in [("this tree", None), *((str(other), other) for other in args.against)]:
                env = {**os.environ, **({"PYTHONPATH": str(source)} if source else {})}
                out = Path(tmp) / "pack"
                os.sync()
                _cache(Path(tmp) / "tokenize" / "tokens", keep=not args.cold)
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(Path(tmp) / "tokenize"), str(out)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                r = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"| {name} | {r['seconds']:.2f} | {r['cpu_s']:.2f} ({r['user_s']:.2f} + {r['sys_s']:.2f}) | "
                    f"{r['tokens'] / r['seconds'] / 1e6:.1f} | "
                    f"{r['tokens'] / r['cpu_s'] / 1e6:.1f} | {r['anon_mb']:.0f} | {r['rss_mb']:.0f} | "
                    f"{r['sha'][:12]}, {r['sha_val'][:12]} | {_load()} |",
                    flush=True,
                )


def _cache(folder: Path, keep: bool) -> None:
    """The shards read into the page cache (`keep`), as right after tokenize, or dropped from it, as at
    10 GB of text, where tokenize wrote them long before pack and the page cache of a small machine no
    longer holds them."""
    for path in folder.glob("*.arrow"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if keep:
                while os.read(fd, 16 << 20):
                    pass
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _write_tokens(folder: Path, tokens: int, documents: int | None) -> None:
    import numpy as np
    import pyarrow as pa

    from cram.stages.data import shards

    (folder / "tokens").mkdir(parents=True)
    rng, names, left = np.random.default_rng(0), [], tokens
    low, high = (20, 500) if documents is None else (20, max(21, 2 * tokens // documents - 20))
    while left > 0:
        lengths = rng.integers(low, high, 20_000)
        values = rng.integers(5, 8192, int(lengths.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        names.append(f"data-{len(names):05d}.arrow")
        with shards.ShardWriter(folder / "tokens" / names[-1], shards.TOKENS) as writer:
            for s in range(0, len(lengths), 1000):
                o = offsets[s : s + 1001]
                ids = pa.ListArray.from_arrays(pa.array(o - o[0]), pa.array(values[o[0] : o[-1]]))
                writer.write({"input_ids": ids})
        left -= int(lengths.sum())
    shards.finish_folder(folder / "tokens", names, shards.TOKENS)


def _child(tokens: Path, out: Path) -> None:
    import resource
    import shutil

    import structlog
    from memory import MemoryPeak

    from cram.stages import Context, Upstream, pack

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    ctx = Context(seed=0, device="cpu", run_dir=out.parent, log=structlog.get_logger())
    upstream = Upstream(tokens, {"vocab_size": 8192, "special_ids": _SPECIAL, "tokens": "tokens"})
    import pyarrow.compute  # noqa: F401  (as the stage does: imports before its clock)

    before = resource.getrusage(resource.RUSAGE_SELF)
    sampler = MemoryPeak(lambda: [os.getpid()], every=0.1)
    outputs = pack.run(pack.Config(), {"tokenize": upstream}, out, ctx)
    sampler.stop()
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    sha = {}
    for split in ("train", "val"):
        with open(out / f"{split}.npy", "rb") as f:
            sha[split] = hashlib.file_digest(f, "sha256").hexdigest()
    result = {"seconds": outputs["seconds"], "tokens": outputs["tokens"], "cpu_s": user + system}
    result |= {"user_s": user, "sys_s": system}
    peaks = {"anon_mb": sampler.anon / 2**20, "rss_mb": sampler.rss / 2**20}
    print(json.dumps({**result, **peaks, "sha": sha["train"], "sha_val": sha["val"]}))


if __name__ == "__main__":
    main()
