"""`[pretrain.fp32]`: the batch and peak lr a run takes where its step trains in fp32, in place of
`[pretrain]`'s; read and checked with the config, in the key only where set, applied by the precision the
device gives the step, and a checkpoint trained under the other decision refused on resume."""

import dataclasses

import pytest
from test_pretrain import pack, small  # noqa: F401 (pack: a fixture)

from cram.pipeline import config as cfg
from cram.pipeline import runner
from cram.pipeline.planning import keyed_config
from cram.stages import StageError, pretrain
from cram.stages.pretraining.resolved import Batch

pytestmark = pytest.mark.usefixtures("one_thread")

TABLE = pretrain.InFp32(microbatch=4, batch_size=4, lr=2e-3)


def test_the_table_sets_batch_and_lr_on_an_fp32_device_and_the_config_stays_as_the_file_says():
    config = small(microbatch=8, batch_size=16, precision="fp32", fp32=pretrain.InFp32(batch_size=8, lr=2e-3))
    assert Batch.on(config, "cpu") == Batch(microbatch=8, batch_size=8, lr=2e-3, by_fp32=True)
    assert (config.batch_size, config.optimizer.lr) == (16, small().optimizer.lr)  # the file's, never rewritten
    plain = dataclasses.replace(config, fp32=pretrain.InFp32())
    assert Batch.on(plain, "cpu") == Batch.given(plain) == Batch(8, 16, small().optimizer.lr)


def test_the_precision_the_device_gives_the_step_decides():
    config = small(fp32=TABLE)
    assert Batch.on(dataclasses.replace(config, precision="fp32"), "cpu") == Batch(4, 4, 2e-3, by_fp32=True)
    assert Batch.on(dataclasses.replace(config, precision="bf16"), "cpu") == Batch.given(config)
    assert not Batch.on(dataclasses.replace(config, precision="fp32", fp32=pretrain.InFp32()), "cpu").by_fp32


def test_the_table_is_in_the_key_only_where_set():
    assert "fp32" not in keyed_config(pretrain, pretrain.Config())
    assert keyed_config(pretrain, pretrain.Config(fp32=TABLE))["fp32"] == {"microbatch": 4, "batch_size": 4, "lr": 2e-3}


@pytest.mark.parametrize(
    "table, message",
    [
        (
            "batch_size = 24\nmicrobatch = 16",
            "fp32: batch_size 24 must be a multiple of microbatch (16) where",
        ),
        ("batch_size = 20", "fp32: batch_size 20 must be a multiple of microbatch (32)"),
        ("lr = 0", "[pretrain.fp32] lr: 0.0 must be > 0"),
        ("batch = 16", "[pretrain.fp32] unknown key 'batch'"),
    ],
)
def test_a_bad_table_is_refused_naming_it(tmp_path, table, message):
    path = tmp_path / "p.toml"
    path.write_text(f"[pretrain.fp32]\n{table}\n")
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load(path, runner.config_classes(runner.default_stages()))
    assert message in str(e.value)


def test_an_fp32_step_trains_at_the_tables_batch_and_lr_and_a_bf16_one_at_pretrains(pack, tmp_path, make_ctx):  # noqa: F811
    budget = pretrain.Budget(steps=2)
    fp32 = pretrain.run(small(budget=budget, fp32=TABLE), {"pack": pack}, tmp_path / "fp32", make_ctx())
    assert (fp32["batch_size"], fp32["peak_lr"]) == (4, 2e-3)
    bf16 = pretrain.run(small(budget=budget, fp32=TABLE, precision="bf16"), {"pack": pack}, tmp_path / "b", make_ctx())
    assert (bf16["batch_size"], bf16["peak_lr"]) == (8, small().optimizer.lr)
    assert fp32["tokens_seen"] * 2 == bf16["tokens_seen"]  # two steps of 4 blocks against two of 8


@pytest.mark.parametrize(
    "started, resumed, then, now",
    [
        ("bf16", "fp32", r"\[pretrain\]'s", r"\[pretrain.fp32\]'s"),
        ("fp32", "bf16", r"\[pretrain.fp32\]'s", r"\[pretrain\]'s"),
    ],
)
def test_a_checkpoint_trained_under_the_other_decision_is_refused_on_resume(
    pack,  # noqa: F811
    tmp_path,
    make_ctx,
    started,
    resumed,
    then,
    now,
):
    out = tmp_path / "out"
    config = small(budget=pretrain.Budget(steps=2), fp32=TABLE, precision=started)
    pretrain.run(config, {"pack": pack}, out, make_ctx())
    with pytest.raises(
        StageError,
        match=rf"step-2: trained at {then} batch and lr, and this machine's step would train at {now}: "
        rf".* pretrain.precision = '{started}'",
    ):
        pretrain.run(dataclasses.replace(config, precision=resumed), {"pack": pack}, out, make_ctx())
    again = pretrain.run(config, {"pack": pack}, out, make_ctx())  # the same decision resumes
    assert again["steps"] == 2
