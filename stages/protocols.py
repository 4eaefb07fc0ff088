"""The stage contract as types: what a stage module is (`Stage`), what its `validate` is handed (`Pipeline`),
what its config, its log and its outputs are (`StageConfig`, `Log`, `JSON`), and `read`, the one place that
reads a stage module and fills in what it leaves out (`StageSpec`); `section`, a sibling stage's section
read as its Config.

A stage is a module of `cram.stages` that defines the members of `Stage` without a default (NAME, VERSION,
UPSTREAM, Config, run) and any of the others it needs. The pipeline never looks a member up on a module
itself: it reads each module once with `read` and calls the `StageSpec`'s members, every one present.

    spec = read(tokenize)                   # or stages.load("tokenize")
    spec.validate(spec.config_in(pipeline), pipeline)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias, TypeVar

if TYPE_CHECKING:
    from cram.stages import Context, Upstream

# A value JSON can hold: what a stage's `run` returns and what a manifest record or a checkpoint's meta holds.
JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None


class StageConfig(Protocol):
    """A stage's `Config` made from its TOML section (or `[run]`'s RunConfig): a frozen dataclass instance.
    Its class, or a table's, may name removed settings in a `RETIRED` class attribute, each mapped to the
    value that computes what the stage now does: the config reader drops them at that value and refuses
    any other (`pipeline/config.py`)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


class Log(Protocol):
    """A structlog logger bound to the run (and the stage), as the stages and the pipeline use it: an event
    and its fields."""

    def info(self, event: str, /, **fields: object) -> object: ...
    def warning(self, event: str, /, **fields: object) -> object: ...
    def error(self, event: str, /, **fields: object) -> object: ...
    def bind(self, **fields: object) -> Log: ...


class RunSettings(Protocol):
    """The `[run]` section as a stage sees it (pipeline/config.py's RunConfig)."""

    @property
    def name(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def root(self) -> str: ...
    @property
    def device(self) -> str: ...


class Pipeline(Protocol):
    """The whole validated config as a stage's `validate`, `validate_runtime`, `describe` and `config_of`
    see it (pipeline/config.py's PipelineConfig; stages never import the pipeline)."""

    @property
    def run(self) -> RunSettings: ...
    @property
    def stages(self) -> Mapping[str, StageConfig]: ...  # section name -> its validated Config


C = TypeVar("C")
S = TypeVar("S")


def section(sections: Mapping[str, object], name: str, cls: type[S]) -> S | None:
    """The pipeline's section `name` (`Pipeline.stages`, or the `sections` a `Linked` config is handed) as
    its stage's Config `cls`; None where the pipeline has no such stage. A stage reads a sibling's settings
    through this, typed, never by probing for an attribute: a section of another type is a bug, not absent."""
    found = sections.get(name)
    if found is not None and not isinstance(found, cls):
        raise TypeError(f"[{name}]: a {type(found).__name__}, not the {cls.__name__} its stage reads")
    return found


class Linked(Protocol):
    """A stage `Config` that takes a default from another section once all are validated: `linked(sections)`
    returns the config with those defaults resolved (tokenize's tokenizer and evaluate's pooling from
    `pretrain.init`'s checkpoint). `sections` maps each section name, `run` included, to its config. A
    Config without it is taken as it is."""

    def linked(self: C, sections: Mapping[str, StageConfig]) -> C: ...


class Stage(Protocol):
    """Every member a stage module may have. Those without a default are required; `read` fills the others."""

    NAME: str  # the TOML section, the output folder and the store entry's prefix
    VERSION: str  # part of every key: bump when the stage's output changes meaning (keys move, stores re-run)
    UPSTREAM: tuple[str, ...]  # the stages whose outputs `run` reads, in ORDER
    Config: type  # a frozen dataclass: the stage's TOML section (see `Linked` for its optional `linked`)

    # True: an interrupted attempt re-enters the same partial folder (pretrain's checkpoints); False: the
    # partial folder is removed when the attempt fails, and started afresh.
    RESUMABLE: bool = False
    # True: `run` is called on every torchrun rank (pretrain: data parallel); False: rank 0 runs it alone
    # while the others wait.
    DISTRIBUTED: bool = False
    # Dotted config fields that change how the stage reports or how fast it runs, never what it computes:
    # left out of the key and of `config_hash` (pretrain's log and checkpoint cadence, tokenize's num_proc).
    NOT_IN_KEY: tuple[str, ...] = ()
    # Dotted config fields added after stores were filled: left out of the key while they hold their
    # default (which computes what the stage computed before them), so old keys do not move and a store
    # filled before them stays valid. Every new option with a default that keeps the old output goes here;
    # forgetting it moves every stored key of the stage and of all stages below it (tests/test_layout.py).
    NEW_OPTIONS: tuple[str, ...] = ()
    # With `config_of`: the setting that gives the stage something to do, named in the error that refuses
    # `--only` or `--force` of it under a config that leaves it out.
    RUNS_WITH: str = ""
    # Instead of a TOML section: the stage's config made from the other sections (the baseline stage's,
    # from [evaluate] and [pretrain]); None when it has nothing to do with this config: the planner leaves
    # it out, and its downstream's key holds no entry for it. Absent (None here): the stage's own section.
    config_of: Callable[[Pipeline], StageConfig | None] | None = None

    def run(self, config: StageConfig, inputs: Mapping[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, JSON]:
        """Compute into `out_dir` alone; return paths relative to it and figures (JSON). StageError: bad input
        or config (exit 2); any other exception: the stage failed (exit 1). Heavy imports go inside."""
        ...

    @staticmethod
    def fingerprint(config: StageConfig) -> list[list[JSON]] | None:
        """What the stage reads from outside the run (paths, sizes, times, hashes of a corpus, task files, a
        checkpoint): its digest is the key's `inputs`. Default: None, nothing."""
        return None

    @staticmethod
    def key_config(config: StageConfig) -> StageConfig | dict[str, JSON]:
        """The config as the key sees it, with what the output does not depend on in it set to a fixed value
        (tokenize: the training fields beside a given tokenizer), or as a plain dict where a field nested in
        a list is left out at its default (evaluate's tasks' retrieval settings). Default: the config itself."""
        return config

    @staticmethod
    def validate(config: StageConfig, pipeline: Pipeline) -> None:
        """The checks `run` would make that need no upstream output and no torch; StageError. Called by the
        planner for every stage not done, before the first stage runs. Default: none."""

    @staticmethod
    def validate_runtime(config: StageConfig, pipeline: Pipeline) -> None:
        """The checks that load torch (device, backend, memory); StageError. Called only for the stages that
        run in this invocation. Default: none."""

    @staticmethod
    def describe(config: StageConfig, pipeline: Pipeline) -> str | None:
        """A line on the work the stage would do, printed under a dry run's plan. Default: None, no line."""
        return None


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """A stage module read once by `read`: every member of `Stage`, present (the module's, or the default)."""

    NAME: str
    VERSION: str
    UPSTREAM: tuple[str, ...]
    Config: type
    run: Callable[..., dict[str, JSON]]
    RESUMABLE: bool
    DISTRIBUTED: bool
    NOT_IN_KEY: tuple[str, ...]
    NEW_OPTIONS: tuple[str, ...]
    RUNS_WITH: str
    config_of: Callable[[Pipeline], StageConfig | None] | None
    fingerprint: Callable[[StageConfig], list[list[JSON]] | None]
    key_config: Callable[[StageConfig], StageConfig | dict[str, JSON]]
    validate: Callable[[StageConfig, Pipeline], None]
    validate_runtime: Callable[[StageConfig, Pipeline], None]
    describe: Callable[[StageConfig, Pipeline], str | None]

    @property
    def has_section(self) -> bool:
        """Whether the stage has a TOML section of its own (no `config_of`)."""
        return self.config_of is None

    def config_in(self, pipeline: Pipeline) -> StageConfig | None:
        """The stage's config in `pipeline`: its section, or what `config_of` makes of the others (None:
        nothing to do with this config)."""
        return pipeline.stages[self.NAME] if self.config_of is None else self.config_of(pipeline)


StageLike = ModuleType | StageSpec  # a stage module, or one `read` already
_REQUIRED = ("NAME", "VERSION", "UPSTREAM", "Config", "run")


def read(stage: StageLike) -> StageSpec:
    """The stage module `stage` with every member present: what it defines, else `Stage`'s default. A
    StageSpec is returned as it is. TypeError naming the member a module lacks."""
    if isinstance(stage, StageSpec):
        return stage
    missing = [name for name in _REQUIRED if not hasattr(stage, name)]
    if missing:
        raise TypeError(f"{stage.__name__}: not a stage, it defines no {', '.join(missing)}")
    members = {f.name: getattr(stage, f.name, getattr(Stage, f.name, None)) for f in dataclasses.fields(StageSpec)}
    return StageSpec(**{**members, "UPSTREAM": tuple(members["UPSTREAM"])})


def linked(section: StageConfig, sections: Mapping[str, StageConfig]) -> StageConfig:
    """`section.linked(sections)` where its Config defines `linked` (see `Linked`), else `section`."""
    link = getattr(section, "linked", None)
    return section if link is None else link(sections)
