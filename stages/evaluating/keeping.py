"""The fine-tuned classifiers evaluate keeps (`[evaluate] keep`): per task the best seed's, every
seed's, or none, as outputs of the stage that the store checksums like every other.

    classifiers/<index>-<task>/seed-<seed>/params.safetensors   encoder and `classifier.` head, fp32 (no MLM head)
    classifiers/<index>-<task>/seed-<seed>/model.json           the encoder's ModelConfig (pretrain's)
    classifiers/<index>-<task>/seed-<seed>/classifier.json      what `cram export --task` and `cram predict` need

A retrieval task's fine-tuned encoder is kept the same way as an embedding model, beside them:

    embedders/<index>-<task>/seed-<seed>/params.safetensors     the encoder alone, fp32 (no head)
    embedders/<index>-<task>/seed-<seed>/model.json             the encoder's ModelConfig (pretrain's)
    embedders/<index>-<task>/seed-<seed>/embedder.json          pooling, normalisation, lengths, tokenizer, scores

"Best" is the highest main score (the task's first metric on its first test set: the score evaluate
reports), the lowest seed on ties. With keep = "best" a rank holds one candidate per task in memory,
its best so far; under torchrun every rank knows every run's scores after the gather, so the rank
holding the overall best writes it (`Keeper.finish`), before the runner's closing collective, so rank 0
hashes a complete folder. With "all" each seed is written as soon as it is scored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages.kept.folder import META, MODEL, PARAMS
from cram.stages.shared.files import write_atomic

if TYPE_CHECKING:
    from cram.stages import Upstream
    from cram.stages.tasks.kind import Scored

FOLDER = "classifiers"
EMBEDDERS, EMBEDDER_META = "embedders", "embedder.json"  # a retrieval task's kept encoder, and its description
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def folder_of(name: str, index: int) -> str:
    """A task's folder under `classifiers/`: its index, then its name (its safe characters and a hash of
    the name where it has others). The index makes it unique, on a file system that ignores case too."""
    if _SAFE.fullmatch(name):
        return f"{index}-{name}"
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{index}-{re.sub(r'[^A-Za-z0-9._-]', '_', name)[:40]}-{digest}"


def main_score(task: Scored, run: dict) -> float:
    """A run's main score (the task's first metric on its first test set); -inf where it is NaN."""
    value = run["scores"][next(iter(task.tests))][task.metrics[0]]
    return -math.inf if math.isnan(value) else value


def best_jobs(jobs: list[tuple[int, int]], runs: dict[int, dict], tasks: list[Scored]) -> dict[int, int]:
    """Task index -> the job (index into `jobs`) of its best seed, from every rank's gathered runs."""
    best: dict[int, int] = {}
    for j, (i, seed) in enumerate(jobs):
        task = tasks[i]
        if i not in best or main_score(task, runs[j]) > main_score(task, runs[best[i]]):
            best[i] = j  # jobs are in seed order: a tie keeps the lower seed
    return best


@dataclass
class Keeper:
    """This rank's side of keeping: `offer` each fine-tuned seed, then `finish` with the overall best."""

    mode: str  # [evaluate] keep (config.py)
    out_dir: Path
    model_json: Path  # pretrain's model config, copied beside each kept classifier
    meta: dict[int, dict]  # task index -> the classifier.json fields every seed of it shares
    held: dict[int, tuple[int, float, dict, dict]] = field(default_factory=dict)  # task -> seed, score, params, run

    def offer(self, index: int, seed: int, task: Scored, params: dict, run: dict) -> None:
        """A fine-tuned seed of task `index`: written now ("all"), held if the best so far ("best")."""
        if self.mode == "none":
            return
        score = main_score(task, run)
        if self.mode == "all":
            self._write(index, seed, score, _on_cpu(params), run)
        elif index not in self.held or score > self.held[index][1]:
            self.held[index] = (seed, score, _on_cpu(params), run)

    def finish(self, jobs: list[tuple[int, int]], best: dict[int, int]) -> dict[str, str]:
        """Write the best candidates this rank holds; return task name -> its kept folder (relative)."""
        kept = {}
        for i, j in best.items():
            seed = jobs[j][1]
            if self.mode == "best" and i in self.held and self.held[i][0] == seed:
                self._write(i, *self.held.pop(i))
            if self.mode != "none":
                kept[self.meta[i]["task"]] = self._folder(i, seed)
        return kept

    def _folder(self, index: int, seed: int) -> str:
        kind = EMBEDDERS if self._embeds(index) else FOLDER
        return f"{kind}/{folder_of(self.meta[index]['task'], index)}/seed-{seed}"

    def _embeds(self, index: int) -> bool:
        return self.meta[index].get("kind") == "embedder"

    def _write(self, index: int, seed: int, score: float, params: dict, run: dict) -> None:
        from safetensors.torch import save_file

        folder = self.out_dir / self._folder(index, seed)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{PARAMS}.tmp-{os.getpid()}"
        save_file(params, tmp, metadata={"format": "pt"})
        os.replace(tmp, folder / PARAMS)
        shutil.copyfile(self.model_json, folder / MODEL)
        # a kind may say more of what it offers (`run["meta"]`: a retrieval seed's fusion with BM25, its encoder)
        meta = {**self.meta[index], **run.get("meta", {}), "seed": seed, "score": score, "scores": run["scores"]}
        meta["params"] = PARAMS
        write_atomic(folder / (EMBEDDER_META if self._embeds(index) else META), json.dumps(meta, indent=1) + "\n")


def kept_outputs(kept: dict[str, str]) -> dict[str, dict[str, str]]:
    """The stage's outputs naming the kept models (`Keeper.finish`'s): `classifiers` and `embedders`, each
    task -> its folder."""
    outputs = {}
    for key in (FOLDER, EMBEDDERS):
        mine = {name: folder for name, folder in kept.items() if folder.startswith(f"{key}/")}
        if mine:
            outputs[key] = mine
    return outputs


def _on_cpu(params: dict) -> dict:
    """What a classifier or an embedder reads of fine-tuned params, copied to the CPU: all but the
    masked-LM head (an embedder's params hold no head)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in params.items() if not k.startswith("head.")}


def tokenizer_fields(tokenize: Upstream) -> dict:
    """How a kept model finds the run's tokenizer: the tokenize stage's key and file, and its special ids."""
    entry = Path(os.path.realpath(tokenize.dir)).name
    return {
        "stage": "tokenize",
        "key": entry.removeprefix("tokenize-") if entry.startswith("tokenize-") else None,
        "file": tokenize.outputs.get("tokenizer"),
        "special_ids": tokenize.outputs.get("special_ids"),
    }
