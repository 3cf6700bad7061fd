"""Typed, frozen run configuration: YAML file + dotted ``key=value`` overrides.

Everything wrong with a configuration is reported here, before TensorFlow builds
anything: an unknown key, a value of the wrong type, or a combination that cannot
work (``train.global_batch`` not divisible by ``parallel.dp x train.grad_accum``,
``model.heads`` not dividing ``model.d_model``, ...). Errors are
:class:`ConfigError`, which names the key, the offending value and what would be
valid; the CLI turns them into exit status 2.

Example:
    >>> from phalanx.config import load_config
    >>> cfg = load_config(None, ["model.layers=2", "train.steps=10"])
    >>> cfg.model.layers, cfg.train.steps
    (2, 10)
    >>> cfg.train.micro_batch
    16
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from phalanx.precision import resolve_policy


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or impossible.

    ``key`` is the dotted key at fault (e.g. ``"train.global_batch"``).
    """

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


PRECISION_POLICIES = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
STRATEGIES = ("auto", "mirrored", "multi_worker", "parameter_server", "mesh")
RECOMPUTE = ("none", "full", "selective")
ATTENTION = ("plain", "blocked")  # phalanx.layers.ParallelSelfAttention's attention cores
TOKENIZERS = ("bytes", "bpe")


@dataclass(frozen=True)
class ModelConfig:
    """GPT decoder shape. ``ffn=0`` means ``4 * d_model``.

    Mixture of experts (``experts >= 2``): every ``moe_every``-th block (blocks
    ``moe_every-1, 2*moe_every-1, ...``) replaces its MLP by ``experts`` MLPs of width
    ``ffn`` and a router sending each token to ``top_k`` of them
    (:class:`phalanx.layers.MoE`); ``capacity_factor`` (0: no token dropped) and the
    load-balancing loss coefficient ``aux_loss_coef`` as there.
    """

    layers: int = 4
    d_model: int = 256
    heads: int = 4
    ffn: int = 0
    vocab: int = 256
    seq_len: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    attention: str = "plain"

    def is_moe_block(self, index: int) -> bool:
        return self.experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism and where they run.

    ``dp``, ``tp`` or ``pp`` may be -1 (at most one of them): it takes whatever
    the device count leaves, see :meth:`Config.resolved`.
    ``devices``: ``auto`` (GPUs if any, else the CPU), ``cpu:N`` (the host CPU
    split into N logical devices) or ``gpu:N`` (the first N GPUs).
    ``ep``: expert parallelism — the experts of ``phalanx.layers.MoE(ep=...)`` layers are
    sharded over groups of ``ep`` data replicas (``ep`` divides ``dp``).
    ``sequence_parallel``: Megatron sequence parallelism alongside ``tp > 1`` (Korthikanti et
    al. 2022): the built-in dense GPT (``tp`` must divide ``model.seq_len``),
    or the ``phalanx.layers.TransformerBlock`` layers of a Keras model through ``phalanx.fit``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    devices: str = "auto"
    strategy: str = "auto"
    zero: int = 0
    recompute: str = "none"
    ep: int = 1
    sequence_parallel: bool = False


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision. Master weights and the loss stay float32 always.

    ``policy``: ``auto`` (the default: ``mixed_bfloat16`` where the hardware has bfloat16
    units — AVX512_BF16 or AMX CPUs, Ampere or newer GPUs, TPUs — else ``float32``; see
    :mod:`phalanx.precision`), ``float32``, ``mixed_bfloat16`` or ``mixed_float16``.
    :class:`Config` resolves ``auto`` when it is built, so ``cfg.precision.policy`` is
    always the policy that runs; ``cfg.precision.reason`` says why (one line).

    Dynamic loss scaling applies to ``mixed_float16`` only: the scale starts at
    ``loss_scale_init``, halves on a step whose gradients overflow (that step is
    skipped and counted) and doubles after ``loss_scale_growth_interval`` good steps.
    """

    policy: str = "auto"
    loss_scale_init: float = 32768.0
    loss_scale_growth_interval: int = 2000

    reason: typing.ClassVar[str | None] = None  # set on the instance when ``auto`` was resolved


@dataclass(frozen=True)
class PruneConfig:
    """Gradual magnitude pruning during training (:mod:`phalanx.prune`), ``train.prune.*``.

    ``target``: final sparsity of the pruned weights (0: off). Masks are recomputed from
    the weights' magnitudes every ``every`` steps from step ``start`` to ``end``, the
    sparsity rising as Zhu & Gupta 2017's cubic ramp ``target x (1 - (1 - (t - start) /
    (end - start))^3)``; after ``end`` the masks stay fixed. ``pattern``: ``unstructured``
    (the smallest weights of each tensor) or ``N:M`` such as ``2:4`` (the N largest of
    every M consecutive weights along the input dimension are kept; ``target`` must be
    ``1 - N/M``). Pruned: the GPT's matmul kernels (names ending ``/kernel``, and
    ``moe/w_in`` / ``moe/w_out``); never embeddings, biases, LayerNorm or the MoE router.
    Nested keys: ``train.prune.target=0.5`` or YAML ``train: {prune: {target: 0.5}}``.
    """

    target: float = 0.0
    start: int = 0
    end: int = 1000
    pattern: str = "unstructured"
    every: int = 100


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation. ``global_batch = micro_batch x dp x grad_accum`` sequences.

    ``peak_flops``: the device's peak FLOP/s for MFU; 0 measures it once per
    machine and dtype with a matmul probe (cached).
    """

    global_batch: int = 16
    grad_accum: int = 1
    steps: int = 300
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    clip_norm: float = 1.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    peak_flops: float = 0.0
    prune: PruneConfig = field(default_factory=PruneConfig)

    @property
    def micro_batch(self) -> int:
        """Sequences per replica per accumulation step (before pipeline micro-batching)."""
        return self.global_batch // self.grad_accum


@dataclass(frozen=True)
class DataConfig:
    """Training data.

    ``source``: ``stdlib`` (the running interpreter's own .py sources, prepared once
    and cached under ``cache_dir``), a directory of prepared TFRecord shards (from
    ``phalanx data prepare``), or a glob of text files to prepare on the fly.
    Every epoch is a full seeded permutation of the training examples (no shuffle
    buffer to size); ``max_bytes`` caps the text read (0: all of it).
    """

    source: str = "stdlib"
    tokenizer: str = "bytes"
    bpe_vocab: int = 4096
    val_fraction: float = 0.02
    cache_dir: str = "~/.cache/phalanx"
    max_bytes: int = 0


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"


@dataclass(frozen=True)
class CheckpointConfig:
    """Save every ``every`` steps (0: only at the end), keep the newest ``keep``.

    ``async`` (the key; the field is ``async_``, ``async`` being a Python keyword): write
    each checkpoint in a background thread from a snapshot taken at the step boundary,
    while training goes on; the next save and the end of training wait for it.
    """

    every: int = 100
    keep: int = 3
    async_: bool = field(default=False, metadata={"key": "async"})


# ``cfg.checkpoint.async`` is a syntax error, but getattr(cfg.checkpoint, "async") (code that
# looks keys up by name) works.
setattr(CheckpointConfig, "async", property(lambda self: self.async_))


def key_of(f: dataclasses.Field) -> str:
    """The config key of a dataclass field (its name unless ``metadata["key"]`` says)."""
    return f.metadata.get("key", f.name)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        # precision.policy=auto -> the policy this machine runs (phalanx.precision), so that
        # every reader of cfg.precision.policy sees it; the reason is kept beside it.
        if self.precision.policy == "auto":

            try:
                policy, reason = resolve_policy("auto", devices=self.parallel.devices)
            except ValueError as err:
                raise ConfigError("precision.policy", str(err)) from None
            resolved = dataclasses.replace(self.precision, policy=policy)
            object.__setattr__(resolved, "reason", reason)
            object.__setattr__(self, "precision", resolved)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return _as_dict(self)

    def replace(self, **sections: Mapping[str, Any]) -> "Config":
        """A copy with some fields of some sections changed, validated.

        >>> Config().replace(train={"steps": 5}).train.steps
        5
        """
        merged = self.to_dict()
        for section, values in sections.items():
            _deep_update(merged.setdefault(section, {}), values)
        new = from_dict(merged)
        reason = getattr(self.precision, "reason", None)
        if reason and "policy" not in (sections.get("precision") or {}) and new.precision.policy == self.precision.policy:
            object.__setattr__(new.precision, "reason", reason)  # still the policy auto chose
        return new


def _as_dict(obj) -> dict[str, Any]:
    """``dataclasses.asdict`` under the config keys (:func:`key_of`)."""
    return {key_of(f): _as_dict(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
            for f in dataclasses.fields(obj)}


def _deep_update(target: dict, values: Mapping[str, Any]) -> None:
    """``target.update(values)``, merging nested mappings (``train={"prune": {"target": 0.5}}``
    keeps the other ``train.prune`` keys)."""
    for key, value in values.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


# ---------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides.

    ``parallel.dp``, when neither the file nor an override gives it and ``parallel.devices``
    names a count (``cpu:N``, ``gpu:N``), is derived as ``N / (tp x pp)``
    (:func:`derive_layout`): ``phalanx train``, ``phalanx plan`` and ``phalanx.init`` read
    the same layout from the same keys.

    >>> load_config(None, ["parallel.devices=cpu:8", "parallel.pp=4", "model.layers=8"]).parallel.dp
    2
    """
    return from_dict(derived(read_raw(path, overrides)))


def derived(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the keys the user left out that follow from others: ``parallel.dp`` from the
    device count (:func:`derive_layout`), the tokenizer and vocabulary from a prepared
    ``data.source`` (:func:`derive_from_data`)."""
    return derive_from_data(derive_layout(raw))


def derive_from_data(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with what a prepared ``data.source`` directory records (its ``manifest.json``,
    written by ``phalanx data prepare``) filled in where not given: ``data.tokenizer``,
    ``data.bpe_vocab`` (a BPE tokenizer's vocabulary) and ``model.vocab`` (the tokenizer's
    vocabulary size). A key given explicitly is kept (and checked against the data when the
    data is read)."""
    data = raw.get("data")
    source = data.get("source") if isinstance(data, dict) else None
    if not isinstance(source, str) or source == "stdlib":
        return raw
    manifest = Path(source).expanduser() / "manifest.json"
    try:
        import json
        entry = json.loads(manifest.read_text()).get("tokenizer") or {}
        name, size = str(entry["name"]), int(entry["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return raw  # not a prepared directory (a glob of text files), or a damaged one: reported when read
    data = dict(data)
    data.setdefault("tokenizer", name)
    if name == "bpe" and data["tokenizer"] == "bpe":
        data.setdefault("bpe_vocab", size)
    model = dict(raw.get("model") or {}) if isinstance(raw.get("model", {}), dict) else raw.get("model")
    if isinstance(model, dict) and data["tokenizer"] == name:
        model.setdefault("vocab", max(size, 256) if name == "bytes" else size)
    return {**raw, "data": data, **({"model": model} if model else {})}


def derive_layout(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (nested plain data) with ``parallel.dp`` filled in when it is not given and
    ``parallel.devices`` names a device count that ``tp x pp`` divides: ``dp = N / (tp x pp)``.
    A degree of -1, ``devices=auto`` or a count ``tp x pp`` does not divide leaves ``dp`` unset
    (the default 1, or the error naming the keys when the product does not match).

    >>> derive_layout({"parallel": {"devices": "cpu:8", "tp": 2}})["parallel"]["dp"]
    4
    """
    par = raw.get("parallel")
    if not isinstance(par, dict) or "dp" in par or not isinstance(par.get("devices"), str):
        return raw
    try:
        _, count = parse_devices(par["devices"])
    except ConfigError:
        return raw  # reported by validation, by key
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    if (count and isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1
            and not isinstance(tp, bool) and not isinstance(pp, bool) and count % (tp * pp) == 0):
        raw = {**raw, "parallel": {**par, "dp": count // (tp * pp)}}
    return raw


def read_raw(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The nested plain data the YAML file at ``path`` (if any) and the overrides give,
    before defaults and validation: exactly the keys the user wrote."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", f"file {str(path)!r} does not exist")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError("config", f"{str(path)!r} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                                        f"{err.start}); a config file is YAML text, e.g. configs/demo.yaml") from None
        try:
            loaded = load_yaml(text, str(path)) or {}
        except yaml.YAMLError as err:
            raise yaml_error(path, err) from None
        if not isinstance(loaded, dict):
            raise ConfigError("config", f"{str(path)!r} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = loaded
    for item in overrides:
        key, value = parse_override(item)
        section, _, name = key.partition(".")
        if not name:
            raise ConfigError(key, f"overrides take the form section.key=value, e.g. train.steps=100; got {item!r}")
        # nested keys (train.prune.target=0.5) go one mapping deeper per dot; _build_section
        # refuses a dotted name that is not a nested section
        parts = key.split(".")
        target = raw
        for i, part in enumerate(parts[:-1]):
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(".".join(parts[:i + 1]), f"must be a mapping, got {target!r}")
        target[parts[-1]] = value
    return raw


def yaml_error(path: str | Path, err: yaml.YAMLError) -> ConfigError:
    """A YAML syntax error as ``FILE:LINE: what is wrong`` (the line PyYAML's mark points to,
    1-based; the context line too when it names another one).

    >>> try:
    ...     load_yaml("train:\\n  steps: [1\\n", "x.yaml")
    ... except yaml.YAMLError as err:
    ...     print(yaml_error("x.yaml", err))
    x.yaml:3: not valid YAML: while parsing a flow sequence (line 2), expected ',' or ']', but got '<stream end>'
    """
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context, where = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and where is not None and (mark is None or where.line != mark.line):
        problem = f"{context} (line {where.line + 1}), {problem}"
    elif context:
        problem = f"{context}, {problem}"
    line = f":{mark.line + 1}" if mark is not None else ""
    return ConfigError(f"{path}{line}", f"not valid YAML: {problem}")


def suggest(word: str, choices: Sequence[str], prefix: str = "") -> str:
    """``" (did you mean PREFIX+X?)"`` for the nearest of ``choices`` (difflib), else ``""``.

    >>> suggest("step", ["steps", "lr"])
    ' (did you mean steps?)'
    """
    import difflib
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but a mapping that names a key twice is an error.

    Plain SafeLoader keeps the last value, so ``train: {lr: 1e-3}`` further down a
    file silently wins over the one a reader sees first.
    """

    source = "<string>"
    key_prefix = ""  # (not "prefix": yaml's Reader has a method of that name)

    def construct_document(self, node):
        _refuse_duplicates(node, self.key_prefix, self.source)
        return super().construct_document(node)


# YAML 1.1 reads "2:4" as the base-60 integer 124 (and "1:30.5" as a float): phalanx
# reads such words as strings (train.prune.pattern=2:4), so drop the sexagesimal forms.
UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if not (tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") and ":" in regexp.pattern)]
    + [(tag, re.compile(regexp.pattern.replace("|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+", "")
                        .replace("|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\\.[0-9_]*", ""), re.X))
       for tag, regexp in resolvers
       if tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") and ":" in regexp.pattern]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _refuse_duplicates(node: yaml.Node, prefix: str, source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                key = key_node.value
                name = f"{prefix}.{key}" if prefix else str(key)
                if key in seen:
                    raise ConfigError(name, f"given twice in {source} (lines {seen[key].start_mark.line + 1} and "
                                            f"{key_node.start_mark.line + 1}); keep one")
                seen[key] = key_node
            else:
                name = prefix
            _refuse_duplicates(value_node, name, source)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicates(item, prefix, source)


def load_yaml(text: str, source: str = "<string>", prefix: str = "") -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (ConfigError naming the dotted key,
    under ``prefix`` if given)."""
    loader = UniqueKeyLoader(text)
    loader.source, loader.key_prefix = source, prefix
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def require_directory(key: str, path: str | Path) -> None:
    """ConfigError naming ``key`` when ``path`` does not exist or is not a directory.

    >>> require_directory("run_dir", "/nonexistent/run")
    Traceback (most recent call last):
    ...
    phalanx.config.ConfigError: run_dir: '/nonexistent/run' does not exist
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(key, f"{str(path)!r} does not exist")
    if not p.is_dir():
        raise ConfigError(key, f"{str(path)!r} is not a directory")


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """Command-line words ``[CONFIG.yaml] key=value ...`` -> (file or None, overrides).

    >>> split_config_args(["my.yaml", "train.steps=5"])
    ('my.yaml', ['train.steps=5'])
    """
    path, overrides = None, []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise ConfigError("config", f"only one config file may be given; got {path!r} and {a!r}")
    return path, overrides


def parse_override(item: str) -> tuple[str, Any]:
    """``"train.lr=3e-4"`` -> ``("train.lr", 0.0003)``; values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(item, "an override must look like section.key=value, e.g. parallel.dp=2")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = load_yaml(text, f"the override {item!r}", key) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def from_dict(raw: Mapping[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested plain data."""
    sections = {f.name: f for f in dataclasses.fields(Config)}
    built: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(str(section), f"unknown section{suggest(section, list(sections))}; valid sections: "
                                            f"{', '.join(sections)}")
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(section, f"must be a mapping of keys, got {values!r}")
        cls = _section_type(sections[section])
        built[section] = _build_section(section, cls, values)
    cfg = Config(**built)
    validate(cfg)
    return cfg


def _section_type(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(Config)
    return hints[f.name]


def _build_section(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key_name, value in values.items():
        key = f"{section}.{key_name}"
        if key_name not in fields:
            raise ConfigError(key, f"unknown key{suggest(key_name, list(fields), section + '.')}; valid keys of "
                                   f"{section!r}: {', '.join(fields)}")
        name = fields[key_name].name
        if dataclasses.is_dataclass(hints[name]):  # a nested section, e.g. train.prune
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise ConfigError(key, f"must be a mapping of keys (e.g. {key}.{dataclasses.fields(hints[name])[0].name}"
                                       f"=...), got {value!r}")
            kwargs[name] = _build_section(key, hints[name], value)
            continue
        if isinstance(value, Mapping) and value:
            raise ConfigError(f"{key}.{next(iter(value))}", f"unknown key: {key} takes one value, not nested keys")
        kwargs[name] = _coerce(key, value, hints[name])
    return cls(**kwargs)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the field type; ints are accepted for floats."""
    if isinstance(typ, types.UnionType):  # not used by the current fields; kept strict
        raise ConfigError(key, "union-typed keys are not supported")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string
            except ValueError:
                pass
        if number is None:
            raise ConfigError(key, f"expected a number, got {value!r}")
        try:
            number = float(number)
        except OverflowError:  # an integer beyond float range
            number = math.inf
        if not math.isfinite(number):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:20] + "..." + repr(value)[-8:]
            raise ConfigError(key, f"expected a finite number, got {shown} (read as {number}); "
                                   f"inf, nan and values beyond +-1.8e308 are not valid")
        return number
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"expected a string, got {value!r}")
    raise ConfigError(key, f"unsupported field type {typ!r}")


# ---------------------------------------------------------------------------
# Validation


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _one_of(key: str, value: str, choices: Sequence[str]) -> None:
    _require(value in choices, key, f"{value!r} is not valid; choose one of: {', '.join(choices)}")


def parse_devices(spec: str) -> tuple[str, int]:
    """``"cpu:4"`` -> ``("cpu", 4)``; ``"auto"`` -> ``("auto", 0)``."""
    if spec == "auto":
        return "auto", 0
    kind, sep, count = spec.partition(":")
    if kind in ("cpu", "gpu") and sep and count.isdigit() and int(count) >= 1:
        return kind, int(count)
    raise ConfigError("parallel.devices", f"{spec!r} is not valid; use auto, cpu:N or gpu:N with N >= 1 (e.g. cpu:8)")


def check_model_shape(m) -> None:
    """Raise :class:`ConfigError` for an impossible GPT shape: the fields ``layers``, ``d_model``,
    ``heads``, ``ffn``, ``vocab``, ``seq_len``, ``dropout``, ``experts``, ``top_k`` and ``moe_every``
    of ``m``, a :class:`ModelConfig` or the planner's ``phalanx.core.costs.ModelSpec`` (one rule
    for both).

    Example:
        >>> check_model_shape(ModelConfig(d_model=256, heads=5))
        Traceback (most recent call last):
        ...
        phalanx.config.ConfigError: model.heads: 5 does not divide model.d_model=256; pick heads from [1, 2, 4, 8, 16, 32, 64, 128, 256]
    """
    for key, value in (("model.layers", m.layers), ("model.d_model", m.d_model), ("model.heads", m.heads),
                       ("model.vocab", m.vocab), ("model.seq_len", m.seq_len)):
        _require(value >= 1, key, f"must be >= 1, got {value}")
    _require(m.ffn >= 0, "model.ffn", f"must be >= 0 (0 means 4 x d_model), got {m.ffn}")
    _require(m.d_model % m.heads == 0, "model.heads",
             f"{m.heads} does not divide model.d_model={m.d_model}; pick heads from "
             f"{_divisors(m.d_model)}")
    _require(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    _require(m.experts == 0 or m.experts >= 2, "model.experts", f"must be 0 (dense) or >= 2, got {m.experts}")
    _require(not m.experts or 1 <= m.top_k <= m.experts, "model.top_k",
             f"must be in [1, model.experts={m.experts}], got {m.top_k}")
    _require(m.moe_every >= 1, "model.moe_every", f"must be >= 1, got {m.moe_every}")
    _require(not m.experts or m.moe_every <= m.layers, "model.moe_every",
             f"{m.moe_every} > model.layers={m.layers} leaves no block with experts")


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` for the first impossible value (device count not needed)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    # Also here, not only when parsing: a Config built directly from the dataclasses skips _coerce.
    nested = [(section.name, getattr(cfg, section.name)) for section in dataclasses.fields(cfg)]
    while nested:
        prefix, obj = nested.pop(0)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f"{prefix}.{key_of(f)}", value))
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{prefix}.{key_of(f)}", f"expected a finite number, got {value}")
    check_model_shape(m)
    _one_of("model.attention", m.attention, ATTENTION)
    _require(m.capacity_factor >= 0, "model.capacity_factor", f"must be >= 0 (0: no token dropped), got "
                                                              f"{m.capacity_factor}")
    _require(m.aux_loss_coef >= 0, "model.aux_loss_coef", f"must be >= 0, got {m.aux_loss_coef}")

    minus_ones = [k for k, v in (("dp", p.dp), ("tp", p.tp), ("pp", p.pp)) if v == -1]
    _require(len(minus_ones) <= 1, "parallel." + (minus_ones[-1] if minus_ones else "dp"),
             "at most one of parallel.dp/tp/pp may be -1 (it fills the remaining devices)")
    for k, v in (("dp", p.dp), ("tp", p.tp), ("pp", p.pp)):
        _require(v >= 1 or v == -1, f"parallel.{k}", f"must be >= 1 or -1 (fill the rest), got {v}")
    _require(p.microbatches >= 1, "parallel.microbatches", f"must be >= 1, got {p.microbatches}")
    _one_of("parallel.schedule", p.schedule, SCHEDULES)
    _require(p.virtual_stages >= 1, "parallel.virtual_stages", f"must be >= 1, got {p.virtual_stages}")
    _require(p.virtual_stages == 1 or p.schedule == "interleaved", "parallel.virtual_stages",
             f"{p.virtual_stages} needs parallel.schedule=interleaved (got {p.schedule!r})")
    parse_devices(p.devices)
    _one_of("parallel.strategy", p.strategy, STRATEGIES)
    _require(p.zero in (0, 1, 2, 3), "parallel.zero", f"{p.zero} is not valid; choose 0, 1, 2 or 3")
    _one_of("parallel.recompute", p.recompute, RECOMPUTE)
    _require(p.ep >= 1, "parallel.ep", f"must be >= 1, got {p.ep}")
    _require(p.dp < 1 or p.dp % p.ep == 0, "parallel.ep",
             f"{p.ep} does not divide parallel.dp={p.dp}: experts are sharded over the data replicas in groups "
             f"of ep; pick ep from {_divisors(max(p.dp, 1))}" +
             (" (under parallel.strategy=multi_worker, parallel.dp is each worker's own replicas: the experts are "
              "sharded within a worker, never across workers)" if p.strategy == "multi_worker" else ""))

    if p.tp > 1:
        _require(m.heads % p.tp == 0, "parallel.tp",
                 f"{p.tp} does not divide model.heads={m.heads}; pick tp from {_divisors(m.heads)}")
        _require(m.ffn_dim % p.tp == 0, "parallel.tp", f"{p.tp} does not divide model.ffn={m.ffn_dim}")
        _require(m.vocab % p.tp == 0, "parallel.tp", f"{p.tp} does not divide model.vocab={m.vocab}")
    if p.pp > 1:
        chunks = p.pp * p.virtual_stages
        _require(m.layers >= chunks, "parallel.pp",
                 f"pp x virtual_stages = {chunks} pipeline chunks need model.layers >= {chunks}, got {m.layers}")
    if p.schedule == "interleaved" and p.pp > 1:
        _require(p.microbatches % p.pp == 0, "parallel.microbatches",
                 f"{p.microbatches} must be a multiple of parallel.pp={p.pp} for the interleaved schedule")

    _one_of("precision.policy", cfg.precision.policy, PRECISION_POLICIES)
    _require(cfg.precision.loss_scale_init > 0, "precision.loss_scale_init", "must be > 0")
    _require(cfg.precision.loss_scale_growth_interval >= 1, "precision.loss_scale_growth_interval", "must be >= 1")

    for key, value in (("train.global_batch", t.global_batch), ("train.grad_accum", t.grad_accum),
                       ("train.steps", t.steps), ("train.log_every", t.log_every),
                       ("train.eval_batches", t.eval_batches)):
        _require(value >= 1, key, f"must be >= 1, got {value}")
    dp = p.dp if p.dp > 0 else 1
    _require(t.global_batch % (dp * t.grad_accum) == 0, "train.global_batch",
             f"{t.global_batch} is not divisible by parallel.dp x train.grad_accum = {dp} x {t.grad_accum}; "
             f"use a multiple of {dp * t.grad_accum}")
    per_replica = t.global_batch // (dp * t.grad_accum)
    _require(per_replica % p.microbatches == 0, "parallel.microbatches",
             f"{p.microbatches} does not divide the per-replica batch {per_replica} "
             f"(train.global_batch / (parallel.dp x train.grad_accum))")
    _require(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    _require(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    _require(t.warmup >= 0, "train.warmup", f"must be >= 0, got {t.warmup}")
    _require(t.clip_norm >= 0, "train.clip_norm", f"must be >= 0 (0 disables clipping), got {t.clip_norm}")
    _require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    _require(0 <= t.beta1 < 1, "train.beta1", f"must be in [0, 1), got {t.beta1}")
    _require(0 <= t.beta2 < 1, "train.beta2", f"must be in [0, 1), got {t.beta2}")
    _require(t.eps > 0, "train.eps", f"must be > 0, got {t.eps}")
    # numpy and Keras seed their generators with 0 <= seed < 2**32 (keras.utils.set_random_seed)
    _require(0 <= t.seed < 2**32, "train.seed", f"must be in [0, 2**32 - 1], got {t.seed}")
    _require(t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 disables evaluation), got {t.eval_every}")
    _require(t.peak_flops >= 0, "train.peak_flops", f"must be >= 0 (0 measures it), got {t.peak_flops}")

    validate_prune(cfg)

    d = cfg.data
    _one_of("data.tokenizer", d.tokenizer, TOKENIZERS)
    _require(0.0 < d.val_fraction < 1.0, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")
    _require(d.bpe_vocab >= 257, "data.bpe_vocab", f"must be >= 257, got {d.bpe_vocab}")
    _require(d.max_bytes >= 0, "data.max_bytes", f"must be >= 0 (0: no limit), got {d.max_bytes}")
    if d.tokenizer == "bytes":
        _require(m.vocab >= 256, "model.vocab", f"{m.vocab} is too small for the bytes tokenizer (256 ids); use >= 256")
    else:
        if m.vocab >= 257:  # a vocabulary a BPE tokenizer can have: the tokenizer's size is what to change
            _require(m.vocab >= d.bpe_vocab, "data.bpe_vocab",
                     f"{d.bpe_vocab} ids do not fit model.vocab={m.vocab}: set data.bpe_vocab={m.vocab} for a "
                     f"{m.vocab}-id BPE tokenizer (a prepared data.source supplies its own), or model.vocab >= "
                     f"{d.bpe_vocab}")
        else:
            _require(False, "model.vocab", f"{m.vocab} is smaller than data.bpe_vocab={d.bpe_vocab}; use >= "
                                           f"{d.bpe_vocab}")

    _require(bool(cfg.run.dir), "run.dir", "must not be empty")
    _require(cfg.checkpoint.every >= 0, "checkpoint.every", f"must be >= 0 (0: only at the end), got {cfg.checkpoint.every}")
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {cfg.checkpoint.keep}")
    refuse_ignored(cfg)


def one_device_overrides() -> list[str]:
    """``key=value`` overrides that put a saved run's configuration on one device: every
    ``parallel.*`` key at its default and ``train.grad_accum=1`` (what evaluation, generation
    and export of a run use; checkpoints do not depend on the layout).

    >>> "parallel.schedule=1f1b" in one_device_overrides()
    True
    """
    layout = [f"parallel.{key_of(f)}={str(f.default).lower() if isinstance(f.default, bool) else f.default}"
              for f in dataclasses.fields(ParallelConfig)]
    return layout + ["train.grad_accum=1"]


def given(cfg: Config, key: str) -> bool:
    """Whether ``key`` (``"train.prune.every"``) differs from its default: how a key the user
    set is told from one left alone (a key set to its default value changes nothing either).

    >>> given(load_config(None, ["model.top_k=1", "model.experts=4"]), "model.top_k")
    True
    """
    return _value(cfg, key) != default_of(key)


def default_of(key: str):
    """The dataclass default of ``key`` (``precision.policy``: ``"auto"``, before it is resolved).

    >>> default_of("train.prune.every")
    100
    """
    cls, default = Config, None
    for part in key.split("."):
        f = next((f for f in dataclasses.fields(cls) if key_of(f) == part), None)
        if f is None:
            raise ConfigError(key, "no such key")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        cls = type(default)
    return default


def _loss_scaled(cfg: Config) -> bool:
    # Under precision.policy=auto (never float16 by itself) phalanx.fit may still run a model built
    # under mixed_float16 with loss scaling: that case is refused where the model is known.
    return cfg.precision.policy == "mixed_float16" or cfg.precision.reason is not None


#: key -> (whether the rest of the configuration gives it an effect, the key(s) that would):
#: a key set away from its default where it has none is refused by :func:`refuse_ignored`.
#: (A key whose effect depends on the engine or the model is refused where that is known:
#: :func:`phalanx.engines.factory.refuse_before_build`, ``phalanx.train.keras_api``.)
MATTERS_ONLY_WITH: dict[str, tuple[typing.Callable[[Config], bool], str]] = {
    "parallel.schedule": (lambda c: c.parallel.pp != 1, "parallel.pp > 1 (it orders a pipeline's micro-batches)"),
    "parallel.microbatches": (lambda c: c.parallel.pp != 1, "parallel.pp > 1 (micro-batches feed a pipeline; "
                                                            "train.grad_accum splits each step's batch without one)"),
    "parallel.sequence_parallel": (lambda c: c.parallel.tp != 1,
                                   "parallel.tp > 1 (its sequence chunks are the tensor ranks')"),
    **{f"model.{name}": (lambda c: c.model.experts > 0, "model.experts >= 2 (a mixture of experts)")
       for name in ("top_k", "capacity_factor", "moe_every", "aux_loss_coef")},
    "data.bpe_vocab": (lambda c: c.data.tokenizer == "bpe", "data.tokenizer=bpe"),
    **{f"precision.{name}": (_loss_scaled, "precision.policy=mixed_float16 (float32 and bfloat16 need no loss "
                                           "scaling)")
       for name in ("loss_scale_init", "loss_scale_growth_interval")},
    **{f"train.prune.{name}": (lambda c: c.train.prune.target > 0, "train.prune.target > 0 (pruning on)")
       for name in ("start", "end", "pattern", "every")},
}


def refuse_ignored(cfg: Config) -> None:
    """Raise :class:`ConfigError` for the first key set away from its default that this
    configuration would ignore (:data:`MATTERS_ONLY_WITH`), naming it and the key that would
    give it an effect.

    >>> refuse_ignored(load_config(None, ["train.prune.target=0.5", "train.prune.every=10"]))
    >>> refuse_ignored(Config().replace(data={"bpe_vocab": 8192}))
    Traceback (most recent call last):
    ...
    phalanx.config.ConfigError: data.bpe_vocab: 8192 is ignored unless data.tokenizer=bpe (data.tokenizer is 'bytes'); set that, or leave data.bpe_vocab at its default 4096
    """
    for key, (matters, needs) in MATTERS_ONLY_WITH.items():
        if given(cfg, key) and not matters(cfg):
            value, default = _value(cfg, key), default_of(key)
            first = needs.split(" ")[0].split("=")[0]
            raise ConfigError(key, f"{value!r} is ignored unless {needs} ({first} is {_value(cfg, first)!r}); set "
                                   f"that, or leave {key} at its default {default!r}")


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)  # (checkpoint.async: the property that reads async_)
    return cfg


def parse_prune_pattern(pattern: str) -> tuple[int, int] | None:
    """``"unstructured"`` -> None; ``"2:4"`` -> ``(2, 4)`` (keep 2 of every 4); ConfigError
    naming ``train.prune.pattern`` otherwise.

    >>> parse_prune_pattern("2:4")
    (2, 4)
    """
    if pattern == "unstructured":
        return None
    n, sep, m = str(pattern).partition(":")
    if sep and n.strip().isdigit() and m.strip().isdigit() and 1 <= int(n) < int(m):
        return int(n), int(m)
    raise ConfigError("train.prune.pattern", f"{pattern!r} is not valid; use unstructured or N:M with 1 <= N < M "
                                             f"(keep N of every M consecutive weights), e.g. 2:4")


def prune_input_dims(m: ModelConfig) -> dict[str, tuple[int, str]]:
    """The input dimension (and the key that sets it) of every kind of pruned weight
    (block 0's names stand for every block)."""
    dims = {"block_0/attn/qkv/kernel": (m.d_model, "model.d_model"),
            "block_0/attn/out/kernel": (m.d_model, "model.d_model")}
    if not all(m.is_moe_block(i) for i in range(m.layers)):  # some block keeps its dense MLP
        dims.update({"block_0/mlp/fc/kernel": (m.d_model, "model.d_model"),
                     "block_0/mlp/proj/kernel": (m.ffn_dim, "model.ffn")})
    if m.experts:
        dims.update({"block_0/moe/w_in": (m.d_model, "model.d_model"), "block_0/moe/w_out": (m.ffn_dim, "model.ffn")})
    if not m.tie_embeddings:
        dims["head/kernel"] = (m.d_model, "model.d_model")
    return dims


def validate_prune(cfg: Config) -> None:
    pr = cfg.train.prune
    _require(0.0 <= pr.target < 1.0, "train.prune.target", f"must be in [0, 1) (0: no pruning), got {pr.target}")
    _require(pr.start >= 0, "train.prune.start", f"must be >= 0, got {pr.start}")
    _require(pr.start < pr.end, "train.prune.end", f"{pr.end} must be > train.prune.start={pr.start}")
    _require(pr.every >= 1, "train.prune.every", f"must be >= 1, got {pr.every}")
    nm = parse_prune_pattern(pr.pattern)
    if nm is None or pr.target == 0:
        return
    n, m = nm
    want = 1.0 - n / m
    _require(abs(pr.target - want) < 1e-4, "train.prune.target",
             f"{pr.target} does not match train.prune.pattern={pr.pattern}, which keeps {n} of every {m} "
             f"weights: set train.prune.target={want:g}")
    for name, (dim, key) in prune_input_dims(cfg.model).items():
        _require(dim % m == 0, "train.prune.pattern",
                 f"{pr.pattern} needs the input dimension of every pruned weight divisible by {m}, but {name} "
                 f"(and its kind in every block) has input dimension {key}={dim}")


def resolve_degrees(cfg: Config, n_devices: int) -> tuple[int, int, int]:
    """(dp, pp, tp) with -1 filled so that dp x pp x tp == n_devices.

    >>> resolve_degrees(Config().replace(parallel={"dp": -1, "tp": 2}), 8)
    (4, 1, 2)
    """
    p = cfg.parallel
    degrees = {"dp": p.dp, "pp": p.pp, "tp": p.tp}
    known = 1
    for v in degrees.values():
        known *= v if v > 0 else 1
    for k, v in degrees.items():
        if v == -1:
            _require(n_devices % known == 0, f"parallel.{k}",
                     f"-1 cannot fill {n_devices} devices: the other degrees multiply to {known}")
            degrees[k] = n_devices // known
    product = degrees["dp"] * degrees["pp"] * degrees["tp"]
    _require(product == n_devices, "parallel.devices",
             f"dp x pp x tp = {degrees['dp']} x {degrees['pp']} x {degrees['tp']} = {product} "
             f"but {n_devices} devices are in use; make them equal (e.g. parallel.devices=cpu:{product}) "
             f"or set one degree to -1")
    return degrees["dp"], degrees["pp"], degrees["tp"]


def describe_layout(cfg: Config, *, dp: int | None = None, tp: int | None = None, pp: int | None = None,
                    workers: int = 1, strategy: str | None = None, precision: str | None = None) -> str:
    """The whole layout of a run in one line, for the status line of ``phalanx train`` and
    ``phalanx.fit``: every parallel degree and option under its config key, the precision and the
    processes. ``dp``/``tp``/``pp``: the degrees the engine resolved (default: the config's);
    ``workers``: processes training together (multi_worker or parameter-server tasks);
    ``strategy``: the tf.distribute strategy or engine that runs it, when known; ``precision``:
    the policy that runs (default: ``precision.policy``).

    >>> describe_layout(Config().replace(precision={"policy": "float32"}))
    'dp=1 tp=1 pp=1 ep=1 schedule=1f1b microbatches=1 grad_accum=1 zero=0 recompute=none sequence_parallel=off float32 workers=1'
    """
    p = cfg.parallel
    schedule = p.schedule + (f" virtual_stages={p.virtual_stages}" if p.schedule == "interleaved" else "")
    parts = [f"dp={dp or p.dp}", f"tp={tp or p.tp}", f"pp={pp or p.pp}", f"ep={p.ep}", f"schedule={schedule}",
             f"microbatches={p.microbatches}", f"grad_accum={cfg.train.grad_accum}", f"zero={p.zero}",
             f"recompute={p.recompute}", f"sequence_parallel={'on' if p.sequence_parallel else 'off'}",
             precision or cfg.precision.policy, f"workers={workers}" + (f" ({strategy})" if strategy else "")]
    return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:12]


# -- the configuration reference: docs/configuration.md is generated from here ---------------
# One line per key: what it means and its valid values. The defaults come from the dataclasses
# above; tests/test_config_reference.py fails when a key has no line here or the page is stale.

MEANINGS: dict[str, str] = {
    "model.layers": "transformer blocks",
    "model.d_model": "hidden size",
    "model.heads": "attention heads (must divide `model.d_model`)",
    "model.ffn": "MLP hidden size (0: 4 x `model.d_model`)",
    "model.vocab": "vocabulary size (at least the tokenizer's: 256 for bytes, `data.bpe_vocab` for bpe; "
                   "not given: a prepared `data.source` supplies its tokenizer's)",
    "model.seq_len": "context length in tokens",
    "model.dropout": "dropout rate on embeddings and residual branches",
    "model.tie_embeddings": "the output head shares the token embedding",
    "model.experts": "mixture of experts: experts per MoE block (0: a dense model)",
    "model.top_k": "experts per token (1: Switch routing; >= 2: renormalised top-k)",
    "model.moe_every": "every N-th block is an MoE block",
    "model.capacity_factor": "expert capacity as a multiple of the even share of tokens (0: no token dropped)",
    "model.aux_loss_coef": "coefficient of the Switch load-balancing loss",
    "model.attention": "attention core: plain (the [T, T] scores and softmax as whole matrices) or blocked (by "
                       "query blocks of 128, causal blocks skipped, scores recomputed in the backward: no [T, T] "
                       "tensor kept; same numbers within round-off). plain is the default: on an AMD Zen 4 CPU the "
                       "blocked core alone ran at 0.86-1.02x plain's speed (benchmarks/results/attention_2026-11-27.md); "
                       "blocked needs no dropout on attention probabilities",
    "parallel.dp": "data-parallel replicas (-1: whatever the device count leaves; not given: devices / (tp x pp) "
                   "when `parallel.devices` names a count)",
    "parallel.tp": "tensor-parallel degree: each split layer's weights over tp devices (divides heads, ffn, vocab; -1 as dp)",
    "parallel.pp": "pipeline stages (-1 as dp)",
    "parallel.microbatches": "pipeline micro-batches per replica and step",
    "parallel.schedule": "pipeline schedule: gpipe, 1f1b or interleaved",
    "parallel.virtual_stages": "model chunks per pipeline rank (interleaved schedule)",
    "parallel.devices": "auto (GPUs if any, else the CPU), cpu:N (the CPU split into N logical devices) or gpu:N",
    "parallel.strategy": "auto, mirrored (one process: the run auto makes without a cluster), multi_worker, "
                         "parameter_server or mesh (see docs/clusters.md)",
    "parallel.zero": "ZeRO stage: 0 off; 1 optimizer state divided over the data replicas; 2 also the gradients; "
                     "3 also the weights",
    "parallel.recompute": "activation recomputation: none, full (whole block) or selective (attention core)",
    "parallel.ep": "expert parallelism: each MoE layer's experts sharded over groups of ep data replicas (divides dp and `model.experts`)",
    "parallel.sequence_parallel": "Megatron sequence parallelism beside tp > 1: LayerNorm, dropout and residuals on sequence chunks",
    "precision.policy": "auto (mixed_bfloat16 where the hardware has bfloat16 units, else float32; the run says which), "
                        "float32, mixed_bfloat16 or mixed_float16; master weights and the loss stay float32",
    "precision.loss_scale_init": "mixed_float16 only: the dynamic loss scale's starting value",
    "precision.loss_scale_growth_interval": "mixed_float16 only: good steps before the loss scale doubles",
    "train.global_batch": "sequences per optimizer step (= micro-batch x dp x grad_accum)",
    "train.grad_accum": "gradient accumulation steps per optimizer step",
    "train.steps": "optimizer steps to train for",
    "train.lr": "peak learning rate",
    "train.min_lr_ratio": "the cosine schedule ends at lr x this",
    "train.warmup": "linear warm-up steps",
    "train.clip_norm": "clip gradients to this global norm (0: no clipping)",
    "train.weight_decay": "AdamW decoupled weight decay (kernels and token embeddings only)",
    "train.beta1": "AdamW first-moment decay",
    "train.beta2": "AdamW second-moment decay",
    "train.eps": "AdamW epsilon",
    "train.seed": "initial weights, dropout masks and data order",
    "train.eval_every": "evaluate every N steps and at the end (0: never)",
    "train.eval_batches": "held-out batches per evaluation",
    "train.log_every": "log a row every N steps",
    "train.peak_flops": "device peak FLOP/s for MFU (0: measured once by a matmul probe and cached)",
    "train.prune.target": "final sparsity of the pruned kernels (0: no pruning; N:M needs 1 - N/M)",
    "train.prune.start": "step at which pruning starts",
    "train.prune.end": "step at which the sparsity reaches its target (cubic ramp); masks fixed after",
    "train.prune.pattern": "unstructured, or N:M such as 2:4 (along each kernel's input dimension)",
    "train.prune.every": "steps between mask updates",
    "data.source": "stdlib (the Python standard library's sources), a prepared directory, or a glob of text files",
    "data.tokenizer": "bytes, or bpe (trained locally on the data); not given: a prepared `data.source` supplies its own",
    "data.bpe_vocab": "BPE vocabulary size (not given: a prepared `data.source` supplies its own)",
    "data.val_fraction": "held-out share of the documents (chosen by document hash; never in training)",
    "data.cache_dir": "prepared datasets and the matmul-peak probe's result",
    "data.max_bytes": "cap on the text read (0: all of it)",
    "run.dir": "the run's outputs: checkpoints, metrics.jsonl, TensorBoard events, loss.png",
    "checkpoint.every": "save every N steps (0: only at the end)",
    "checkpoint.keep": "newest checkpoints kept",
    "checkpoint.async": "write checkpoints in a background thread from a snapshot taken at the step boundary",
}


def config_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any]]:
    """Every ``(dotted key, default)`` of the config, in declaration order.

    >>> config_keys()[0]
    ('model.layers', 4)
    """
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += config_keys(type(default), f"{prefix}{key_of(f)}.")
        else:
            keys.append((f"{prefix}{key_of(f)}", default))
    return keys


def sections() -> dict[str, type]:
    """The config's sections (nested ones by dotted name) and their dataclasses.

    >>> list(sections())
    ['model', 'parallel', 'precision', 'train', 'train.prune', 'data', 'run', 'checkpoint']
    """
    found = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else None
            if dataclasses.is_dataclass(default):
                found[prefix + key_of(f)] = type(default)
                walk(type(default), f"{prefix}{key_of(f)}.")

    walk(Config, "")
    return found


def _markdown_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _markdown_doc(cls: type) -> str:
    """A section's docstring as Markdown (reST roles and double backticks to code spans)."""
    import inspect
    text = inspect.cleandoc(cls.__doc__ or "") if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def reference_markdown() -> str:
    """docs/configuration.md: every key, its default and meaning, section by section.

    >>> "| `parallel.ep` | 1 |" in reference_markdown()
    True
    """
    missing = [k for k, _ in config_keys() if k not in MEANINGS]
    extra = sorted(set(MEANINGS) - {k for k, _ in config_keys()})
    if missing or extra:
        raise KeyError(f"phalanx.config.MEANINGS: no meaning for {missing}; not a config key: {extra}")
    lines = ["# Configuration reference", "",
             "<!-- generated from src/phalanx/config.py: python -m phalanx.config --markdown > docs/configuration.md -->",
             "", "A run is configured by one YAML file of sections and `section.key=value` overrides on the command "
             "line (values are read as YAML scalars), for `phalanx train`, `phalanx plan`, `phalanx schedule` and "
             "`phalanx.init`:", "",
             "```", "phalanx train configs/demo.yaml train.steps=50 parallel.devices=cpu:2 parallel.dp=2", "```", "",
             "```yaml", "model: {layers: 2, d_model: 64}", "train:", "  steps: 50", "  prune: {target: 0.5}", "```", "",
             "An unknown key, a value of the wrong type or a combination that cannot work is an error naming the key, "
             "the value and what would be valid, before anything is built. `configs/` holds ready files.", ""]
    keys = config_keys()
    for name, cls in sections().items():
        own = [(k, v) for k, v in keys if k.rsplit(".", 1)[0] == name]
        lines += [f"## `{name}`", ""]
        doc = _markdown_doc(cls)
        if doc:
            lines += [doc, ""]
        lines += ["| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{k}` | {_markdown_value(v)} | {MEANINGS[k]} |" for k, v in own]
        lines.append("")
    return "\n".join(lines)


def sections_help() -> str:
    """The config's sections and keys in a few lines, for ``phalanx train --help``."""
    import textwrap
    keys = config_keys()
    lines = ["config keys, as section.key=value (defaults and meanings: docs/configuration.md,",
             "or python -m phalanx.config --markdown):"]
    for name in sections():
        own = " ".join(k.rsplit(".", 1)[1] for k, _ in keys if k.rsplit(".", 1)[0] == name)
        lines.append(textwrap.fill(own, 96, initial_indent=f"  {name + ':':<14}", subsequent_indent=" " * 16))
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--markdown"]:
        print("usage: python -m phalanx.config --markdown   (prints docs/configuration.md)", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(reference_markdown())
