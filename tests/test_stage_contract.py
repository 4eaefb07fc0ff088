"""The stage contract (stages/protocols.py): a module read once, every member present."""

from __future__ import annotations

import dataclasses
import types

import fake_stages
import pytest

from cram import stages
from cram.stages import protocols


def test_a_module_is_read_with_the_defaults_of_what_it_leaves_out():
    module = fake_stages.modules()[1]  # beta: NAME, VERSION, UPSTREAM, RESUMABLE, DISTRIBUTED, Config, run, validate
    spec = protocols.read(module)
    assert (spec.NAME, spec.UPSTREAM, spec.run, spec.validate) == ("beta", ("alpha",), module.run, module.validate)
    assert spec.NOT_IN_KEY == spec.NEW_OPTIONS == () and spec.RUNS_WITH == "" and spec.has_section
    config = fake_stages.Config(value=3)
    assert spec.fingerprint(config) is None and spec.describe(config, None) is None
    assert spec.key_config(config) is config and spec.validate_runtime(config, None) is None
    assert protocols.read(spec) is spec


def test_a_module_without_a_required_member_is_named():
    module = types.ModuleType("half")
    module.NAME, module.VERSION, module.UPSTREAM, module.Config = "half", "1", (), fake_stages.Config
    with pytest.raises(TypeError, match="half: not a stage, it defines no run"):
        protocols.read(module)


def test_the_protocol_and_the_spec_name_the_same_members():
    declared = {n for n in vars(protocols.Stage) if not n.startswith("_")} | set(protocols.Stage.__annotations__)
    assert declared == {f.name for f in dataclasses.fields(protocols.StageSpec)}


@pytest.mark.parametrize("name", stages.ORDER)
def test_each_stage_reads_as_it_defines_itself(name):
    import importlib

    module = importlib.import_module(f"cram.stages.{name}")
    spec = stages.load(name)
    for field in dataclasses.fields(spec):
        if field.name in vars(module):
            assert getattr(spec, field.name) == (
                tuple(vars(module)[field.name]) if field.name == "UPSTREAM" else vars(module)[field.name]
            )
    assert spec.has_section == (name != "baseline")


def test_a_config_links_only_where_it_defines_linked():
    @dataclasses.dataclass(frozen=True)
    class Linking:
        value: int = 0

        def linked(self, sections):
            return dataclasses.replace(self, value=sections["other"].value)

    other = fake_stages.Config(value=7)
    assert protocols.linked(Linking(), {"other": other}) == Linking(7)
    assert protocols.linked(other, {"other": other}) is other


def test_a_sibling_section_is_read_as_its_stages_config_or_none():
    from cram.stages.pretraining.config import Config as PretrainConfig

    pretrain = PretrainConfig(init="ckpt")
    assert stages.section({"pretrain": pretrain}, "pretrain", PretrainConfig) is pretrain
    assert stages.section({}, "pretrain", PretrainConfig) is None
    with pytest.raises(TypeError, match=r"\[pretrain\]: a SimpleNamespace, not the Config its stage reads"):
        stages.section({"pretrain": types.SimpleNamespace(init="ckpt")}, "pretrain", PretrainConfig)
