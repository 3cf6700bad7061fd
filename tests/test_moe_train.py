"""``phalanx train`` with expert parallelism (issue 11's "Done when"): the MoE GPT of
configs/moe.yaml at dp4 x ep2 on 4 logical CPUs, against the run of the same config on one
device, checkpoints that cross between the two, and the refusals; layouts step for step against
Keras's own one-device ``train_on_batch`` of the same Keras model (tests/gpt_oracle.py).

The balancing loss is a product of two means over the tokens a replica sees (Switch eq. 4),
so with ``aux_loss_coef > 0`` a data-parallel run (ep or not) balances each replica's rows and
its loss is not the one-device loss of the whole batch (7e-4 relative apart after 6 steps
here). Hence: without the balancing loss, dp4 x ep2 = one device; with it (moe.yaml's 0.01),
dp4 x ep2 = one device with ``train.grad_accum=4``, whose four micro-batches are the four
replicas' rows, each balanced by itself (the Keras oracle cuts its batch alike:
``helpers.ghost_batches``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.config import ConfigError, load_config
from phalanx.train.progress import read_metrics

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "moe.yaml")
EP2 = ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2"]
ONE = ["parallel.devices=cpu:1", "parallel.dp=1", "parallel.ep=1"]
STEPS = 6


def small(tmp: Path, run: str, steps: int = STEPS, aux: float = 0.0) -> list[str]:
    """configs/moe.yaml made small and quick: 8 experts top-2 as there, no token dropped
    (capacity_factor 0), dropout 0, float32, clipping active (a clip_norm below the
    gradients' norm), a high learning rate so the loss falls within a few steps, constant after
    one warm-up step (min_lr_ratio 1: a run of 3 steps resumed to 6 has the 6-step schedule)."""
    return ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=32", "model.seq_len=16",
            "train.global_batch=8", f"train.steps={steps}", "train.lr=1e-2", "train.warmup=1",
            "train.min_lr_ratio=1", "train.clip_norm=0.5", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=3", f"model.aux_loss_coef={aux}", "precision.policy=float32",
            "data.max_bytes=200000", f"data.cache_dir={tmp / 'cache'}", f"run.dir={tmp / run}"]


def train(tmp: Path, run: str, layout: list[str], steps: int = STEPS, aux: float = 0.0) -> list[dict]:
    assert main(["train", CONFIG, "--quiet", *small(tmp, run, steps, aux), *layout]) == 0
    return read_metrics(tmp / run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-device run and the Done-when layout (dp4 x ep2), STEPS steps each, without the
    balancing loss."""
    tmp = tmp_path_factory.mktemp("moe_train")
    return tmp, train(tmp, "one", ONE), train(tmp, "ep2", EP2)


def test_done_when_command_trains_and_equals_the_one_device_run(runs):
    tmp, one, ep2 = runs
    losses = [r["loss"] for r in ep2]
    assert [r["step"] for r in ep2] == list(range(1, STEPS + 1))
    assert losses[-1] < losses[0] - 0.3, losses                       # it learns
    np.testing.assert_allclose(losses, [r["loss"] for r in one], rtol=1e-4)
    # the optimizer's figures are phalanx's: the same schedule, clipped norm and loss scale
    for key in ("lr", "grad_norm", "loss_scale", "skipped"):
        np.testing.assert_allclose([r[key] for r in ep2], [r[key] for r in one], rtol=1e-4, err_msg=key)
    assert max(r["grad_norm"] for r in ep2) > 0.5                     # train.clip_norm=0.5 clipped
    for row in ep2:                                                   # MoE figures of the whole step
        assert row["moe_dropped"] == 0.0 and row["moe_aux_loss"] == 0.0
        assert row["moe_load_min"] <= 1.0 <= row["moe_load_max"]
    import json
    layout = json.loads((tmp / "ep2" / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())["layout"]
    assert layout["engine"] == "KerasGPTEngine" and layout["dp"] == 4


def test_phalanx_eval_reads_an_ep2_run_on_one_device(runs, capsys):
    import json

    tmp = runs[0]
    results = {}
    for run in ("one", "ep2"):
        capsys.readouterr()
        assert main(["eval", str(tmp / run), "--json", "train.eval_batches=2"]) == 0
        results[run] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["ep2"]["step"] == STEPS
    assert results["ep2"]["eval_loss"] == pytest.approx(results["one"]["eval_loss"], rel=1e-4)


def test_the_docstring_example_runs():
    import doctest

    from phalanx.engines import keras_gpt
    assert doctest.testmod(keras_gpt).failed == 0


@pytest.mark.slow
def test_with_the_balancing_loss_ep2_equals_one_device_balancing_each_replicas_rows(runs):
    """moe.yaml's aux_loss_coef=0.01: dp4 x ep2 against one device with 4 micro-batches."""
    tmp = runs[0]
    ep2 = train(tmp, "ep2_aux", EP2, aux=0.01)
    accum = train(tmp, "accum_aux", ONE + ["train.grad_accum=4"], aux=0.01)
    losses = [r["loss"] for r in ep2]
    assert losses[-1] < losses[0] - 0.3, losses
    np.testing.assert_allclose(losses, [r["loss"] for r in accum], rtol=1e-4)
    for row in ep2:
        assert row["moe_dropped"] == 0.0
        assert row["moe_balance"] >= 1.0 - 1e-6                     # E x sum f_e P_e, 1 when uniform
        assert row["moe_aux_loss"] == pytest.approx(0.01 * row["moe_balance"], rel=1e-5)  # one MoE block


@pytest.mark.slow
def test_a_checkpoint_crosses_between_ep2_and_one_device(runs):
    """ep2 for 3 steps, resumed on one device (the built-in engine) for 3 more, and the
    reverse, also with ZeRO-3 (each replica's slices of the weights and moments, an expert
    shard's in one slice per ep group): the losses of an uninterrupted one-device run (names
    and values cross)."""
    tmp, one, _ = runs
    uninterrupted = [r["loss"] for r in one]
    zero3 = EP2 + ["parallel.zero=3"]
    for name, first, second in (("ep2_then_one", EP2, ONE), ("one_then_ep2", ONE, EP2),
                                ("ep2_zero3_then_one", zero3, ONE + ["parallel.zero=0"]),
                                ("one_then_ep2_zero3", ONE, zero3)):
        head = train(tmp, name, first, steps=3)
        tail = train(tmp, name, second)
        assert [r["step"] for r in tail] == list(range(1, STEPS + 1))  # metrics.jsonl: both runs' rows
        np.testing.assert_allclose([r["loss"] for r in tail], uninterrupted, rtol=1e-4, err_msg=name)
        assert len(head) == 3


def test_the_engine_state_has_the_builtin_names_and_moments(devices):
    """The state of the ep2 engine: the built-in names and shapes, and after the same steps the
    values of Keras's one-device train_on_batch (weights and AdamW moments, whole experts joined from the shards)."""
    import gpt_oracle
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, ["model.layers=2", "model.d_model=16", "model.heads=2", "model.ffn=16",
                             "model.seq_len=8", "model.experts=4", "model.moe_every=1", "train.global_batch=4",
                             "train.lr=1e-2", "train.warmup=1", "precision.policy=float32",
                             "model.aux_loss_coef=0", "parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"])
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 256, (4, 9)).astype("int32") for _ in range(3)]
    ours = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    assert isinstance(ours, KerasGPTEngine) and ours.dp == 2 and ours.num_params() == sum(
        int(np.prod(v.shape)) for v in ours.model.trainable_variables)
    ref = gpt_oracle.KerasGPT(cfg)  # Keras's one-device train_on_batch of the same model
    for b in batches:
        ours.train_step(b)
        ref.train_step(b)
    mine, want = ours.state_dict(), ref.state_dict()
    assert sorted(mine) == sorted(want)
    for name in want:  # absolute slack at the tensor's scale: a key bias's gradient is round-off (softmax
        # ignores it), and so are its few-1e-6 values; a wrong mapping is off at the scale itself
        scale = float(np.max(np.abs(want[name]))) if np.size(want[name]) else 0.0
        np.testing.assert_allclose(mine[name], want[name], rtol=2e-4, atol=5e-4 * scale + 1e-12, err_msg=name)
    # loading a state moves every value, moments and step included, into the shards
    ref.train_step(batches[0])
    ours.load_state_dict(ref.state_dict())
    again = ours.state_dict()
    for name, value in ref.state_dict().items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    with pytest.raises(KeyError, match="lacks"):
        ours.load_state_dict({k: v for k, v in want.items() if k != "optimizer/step"})


@pytest.mark.parametrize("extra,key", [
    (["parallel.strategy=parameter_server"], "parallel.strategy"),
    (["parallel.microbatches=2"], "parallel.microbatches"),
    (["model.experts=0"], "parallel.ep.*model.experts=0"),
    (["model.experts=6", "parallel.ep=4", "parallel.devices=cpu:4"], "parallel.ep.*divide model.experts=6"),
])
def test_what_the_expert_parallel_engine_cannot_honour_is_refused(extra, key):
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    with pytest.raises(ConfigError, match=key):  # (parallel.microbatches with pp=1: refused as the config is read)
        cfg = load_config(None, ["model.experts=4", "model.moe_every=1", "model.layers=2", "train.global_batch=8",
                                 "parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", *extra])
        build_engine(cfg, GPTTask(cfg.model))


def test_impossible_expert_layouts_are_config_errors():
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    with pytest.raises(ConfigError, match=r"parallel.ep.*does not divide parallel.dp=2"):
        load_config(None, ["model.experts=4", "parallel.dp=2", "parallel.ep=4"])
    cfg = load_config(None, ["model.experts=4", "model.layers=2", "parallel.devices=cpu:2", "parallel.dp=2",
                             "parallel.ep=2"])
    with pytest.raises(ConfigError, match="parallel.ep.*one process"):
        build_engine(cfg, GPTTask(cfg.model), cluster=object())      # not a setup_cluster set-up
    with pytest.raises(TypeError, match=r"trains the built-in GPT \(a GPTTask\), got ModelConfig; .*phalanx\.fit"):
        build_engine(cfg, cfg.model)  # anything but the built-in GPT's task: a Keras model trains through phalanx.fit


@pytest.mark.parametrize("layout", [
    ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"],
    ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2"],
    ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2"],
], ids=["dp2_ep2", "dp2_ep2_pp2", "dp2_tp2_ep2"])
def test_mixed_float16_loss_scale_skips_and_halves_as_the_builtin_engine(devices, layout):
    """An overflowing loss scale (1e30 x the loss in float16): every step is skipped, the scale
    halves, the optimizer step (and so the learning rate) stays and no weight moves, as on the
    one-device Keras oracle; with the pipeline's and the tensor shards' gradients too."""
    import gpt_oracle
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=32",
                             "model.seq_len=16", "model.experts=4", "model.moe_every=2", "train.global_batch=8",
                             "precision.policy=mixed_float16", "precision.loss_scale_init=1e30", "train.warmup=4",
                             *layout])
    ours = build_engine(cfg, GPTTask(cfg.model, cfg.precision.policy, cfg.train.seed))
    ref = gpt_oracle.KerasGPT(cfg, cfg.precision.policy)  # Keras's one-device train_on_batch
    before = ours.weights()
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = rng.integers(0, 256, (8, 17)).astype("int32")
        a, b = ours.train_step(batch), ref.train_step(batch)
        for key in ("skipped", "loss_scale", "lr"):
            assert float(a[key]) == pytest.approx(b[key], rel=1e-6), key
        assert float(a["skipped"]) == 1.0
        assert float(a["loss"]) == pytest.approx(b["loss"], rel=1e-3)  # float16 compute, two models
    state = ours.state_dict()
    assert int(state["loss_scale/skipped"]) == 3 and int(state["optimizer/step"]) == 0
    assert float(state["loss_scale/scale"]) == pytest.approx(1e30 / 8, rel=1e-6)
    for name, value in ours.weights().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


# -- ep composed with pp and tp -------------------------------------------------------------

TINY = ["model.layers=2", "model.d_model=16", "model.heads=2", "model.ffn=16", "model.seq_len=8",
        "model.experts=4", "model.moe_every=1", "model.top_k=2", "model.capacity_factor=0", "train.global_batch=8",
        "train.lr=1e-2", "train.warmup=1", "train.min_lr_ratio=1", "train.clip_norm=0.5", "train.steps=3",
        "precision.policy=float32"]


def tiny_batches(n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(2)
    out = []
    for _ in range(n):
        b = rng.integers(0, 256, (8, 9)).astype("int32")
        b[4:] %= 5  # the second replica's rows use 5 token ids: its routing (and balance) differ
        out.append(b)
    return out


def assert_same_state(mine: dict, want: dict) -> None:
    assert sorted(mine) == sorted(want)
    for name in want:  # as test_the_engine_state_has_the_builtin_names_and_moments: slack at the tensor's
        scale = float(np.max(np.abs(want[name]))) if np.size(want[name]) else 0.0  # scale (the key bias)
        np.testing.assert_allclose(mine[name], want[name], rtol=2e-4, atol=5e-4 * scale + 1e-12, err_msg=name)


@pytest.mark.parametrize("name,layout,accum", [
    # pp2 with 2 micro-batches per replica: 4 micro-batches in all, each balanced by itself
    ("dp2_ep2_pp2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2",
                     "parallel.microbatches=2"], 4),
    ("dp2_tp2_ep2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2"], 2),
    # ZeRO-3: tensor and expert shards gathered from their slices, per stage (ep x pp x ZeRO-3 quickly:
    # tests/test_keras_zero.py's MoE model)
    pytest.param("dp2_ep2_pp2_zero3", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2",
                                       "parallel.microbatches=2", "parallel.zero=3"], 4, marks=pytest.mark.slow),
    ("dp2_tp2_ep2_zero3", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2",
                           "parallel.zero=3"], 2),
    # the MoE GPT without expert parallelism trains on the same engine (ep=1: whole experts)
    ("dp2_pp2_ep1", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"], 4),
])
def test_expert_parallelism_composes_with_pp_and_tp_as_one_device(devices, name, layout, accum):
    """What ``phalanx train`` builds for ep x pp and ep x tp (the factory's engine) against the
    Keras's one-device train_on_batch of the same model with the balancing loss on, its batch
    cut into the micro-batches the layout balances separately (``chunks``): loss, lr and clipped
    gradient norm step for step, then every weight and AdamW moment."""
    import gpt_oracle
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, TINY + ["model.aux_loss_coef=0.1", *layout])
    one = load_config(None, TINY + ["model.aux_loss_coef=0.1", f"train.grad_accum={accum}"])
    ours = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    ref = gpt_oracle.KerasGPT(one, chunks=accum)  # Keras's train_on_batch, each micro-batch balanced alone
    assert isinstance(ours, KerasGPTEngine) and (ours.dp, ours.tp, ours.pp, ours.ep) == (
        2, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
    norms = []
    for batch in tiny_batches():
        a, b = ours.train_step(batch), ref.train_step(batch)
        for key in ("loss", "lr", "grad_norm", "skipped"):
            np.testing.assert_allclose(float(a[key]), b[key], rtol=1e-4, err_msg=key)
        norms.append(b["grad_norm"])
    assert max(norms) > 0.5  # train.clip_norm=0.5 clipped
    assert_same_state(ours.state_dict(), ref.state_dict())
    zero3 = cfg.parallel.zero == 3

    def where(variables) -> set:  # where weights live between steps: themselves, or under ZeRO-3 their slices
        return {s.value.device for v in variables for s in (ours.engine.slices.slices_of(v) if zero3 else [v])}

    blocks = [ours.model.get_layer(f"block_{i}").moe for i in range(2)]
    devices_of = [where(moe.w_in) for moe in blocks]
    assert all(len(d) == cfg.parallel.ep for d in devices_of)  # ep expert shards on ep devices (dp/ep = 1 slice)
    if ours.pp == 2:  # the two MoE blocks sit on different pipeline stages
        assert not devices_of[0] & devices_of[1]
    else:  # the attention of replica 0 cut over its two tensor devices (ZeRO-3: each replica's, sliced)
        attn = ours.model.get_layer("block_0").attention
        assert len(where(attn.trainable_variables)) == 2 * (2 if zero3 else 1)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name,layout,accum", [
    ("dp2_ep2_pp2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2",
                     "parallel.microbatches=2"], 4),
    ("dp2_tp2_ep2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2"], 2),
])
def test_expert_parallelism_with_pp_and_tp_under_mixed_precision(devices, name, layout, accum, policy):
    """ep x pp and ep x tp under a mixed policy against Keras's one-device train_on_batch under
    the same policy (micro-batches as in the float32 test): the losses and
    clipped norms to the tolerances of the other mixed-precision tests (bfloat16 keeps 8 bits
    of mantissa: rtol 1e-2 on the loss, 5e-2 on the norm, as tests/test_parallel.py), the same
    schedule, loss scale and skipped steps (mixed_float16: phalanx's LossScale, at its default
    2^15 no step overflows), and weights that moved as the reference's did: each tensor's
    distance to the reference's is a small part of how far the reference moved it (a wrong
    mapping or sign would be as far as the move itself)."""
    import gpt_oracle
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, TINY + ["model.aux_loss_coef=0.1", f"precision.policy={policy}", *layout])
    one = load_config(None, TINY + ["model.aux_loss_coef=0.1", f"precision.policy={policy}",
                                    f"train.grad_accum={accum}"])
    ours = build_engine(cfg, GPTTask(cfg.model, policy, cfg.train.seed))
    ref = gpt_oracle.KerasGPT(one, policy, chunks=accum)  # Keras's train_on_batch, micro-batches balanced alone
    block = ours.model.get_layer("block_0")
    assert block.moe.compute_dtype == policy.split("_")[1] and block.moe.w_in[0].dtype == "float32"
    start = ref.weights()
    for batch in tiny_batches():
        a, b = ours.train_step(batch), ref.train_step(batch)
        np.testing.assert_allclose(float(a["loss"]), b["loss"], rtol=1e-2)
        np.testing.assert_allclose(float(a["grad_norm"]), b["grad_norm"], rtol=5e-2)
        for key in ("lr", "loss_scale", "skipped"):
            assert float(a[key]) == pytest.approx(b[key], rel=1e-6), key
        assert float(a["skipped"]) == 0.0
    mine, want, d = ours.weights(), ref.weights(), cfg.model.d_model
    assert sorted(mine) == sorted(want)
    for name_, value in want.items():
        ours_, first = mine[name_], start[name_]
        if name_.endswith("attn/qkv/bias"):  # the key bias: softmax ignores it, its gradient is round-off
            keep = np.r_[0:d, 2 * d:3 * d]
            ours_, value, first = ours_[keep], value[keep], first[keep]
        moved = np.linalg.norm(value - first)
        assert moved > 0, name_  # every weight has a gradient
        # bfloat16 gradients near zero flip Adam's step of a few entries: measured <= 0.16 of the move
        assert np.linalg.norm(ours_ - value) <= 0.25 * moved, name_
    state = ours.state_dict()
    assert int(state["optimizer/step"]) == 3 and int(state["loss_scale/skipped"]) == 0


def test_dp2_tp2_ep2_trains_as_keras_own_one_device_steps(devices):
    """An independent oracle: Keras's own train step (``train_on_batch``) of the same
    :func:`phalanx.models.transformer.gpt` model on one device, with Keras's AdamW set as
    ``train.*`` (constant lr, global-norm clip). No weight decay: Keras would decay every
    weight, phalanx kernels and embeddings only. ``train.eps=1e-12``: Keras adds epsilon to
    the uncorrected ``sqrt(v)``, phalanx to the bias-corrected one (Loshchilov & Hutter), which
    moves a weight with a gradient near 1e-7 by a fraction of lr. No balancing loss: one
    device would balance the whole batch, the replicas their own rows."""
    import keras

    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask
    from phalanx.models import transformer

    cfg = load_config(None, TINY + ["model.aux_loss_coef=0", "train.warmup=0", "train.weight_decay=0",
                                    "train.eps=1e-12", "parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2",
                                    "parallel.ep=2"])
    t = cfg.train
    ours = build_engine(cfg, GPTTask(cfg.model, "float32", t.seed))
    model = transformer.gpt(cfg.model, seed=t.seed, name="keras_reference")
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=t.lr, weight_decay=0.0, beta_1=t.beta1,
                                                   beta_2=t.beta2, epsilon=t.eps, global_clipnorm=t.clip_norm),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for batch in tiny_batches():
        want = model.train_on_batch(batch[:, :-1], batch[:, 1:], return_dict=True)["loss"]
        np.testing.assert_allclose(float(ours.train_step(batch)["loss"]), want, rtol=1e-4)
    mine, d = ours.weights(), cfg.model.d_model
    for name, value in transformer.gpt_weights(model).items():
        if name.endswith("attn/qkv/bias"):  # the key bias: softmax ignores it, its gradient is round-off
            keep = np.r_[0:d, 2 * d:3 * d]
            mine[name], value = mine[name][keep], value[keep]
        # atol 0.1% of one step (Adam moves a weight by about lr per step): measured <= 0.03%
        np.testing.assert_allclose(mine[name], value, rtol=2e-4, atol=1e-3 * t.lr, err_msg=name)


@pytest.mark.slow
def test_phalanx_train_runs_ep_with_tp_and_pp_as_one_device(runs):
    """The command end to end on dp2 x tp2 x pp2 x ep2 (8 logical CPUs, 2 micro-batches per
    replica): the logged losses, lr and clipped norms of the one-device run, the MoE figures
    of the whole step, and a checkpoint that records the layout."""
    import json

    tmp, one, _ = runs
    layout = ["parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2",
              "parallel.microbatches=2"]
    rows = train(tmp, "dp2_tp2_pp2_ep2", layout)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in rows], [r[key] for r in one], rtol=1e-4, err_msg=key)
    for row in rows:
        assert row["moe_dropped"] == 0.0 and row["moe_load_min"] <= 1.0 <= row["moe_load_max"]
    meta = json.loads((tmp / "dp2_tp2_pp2_ep2" / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
    assert {k: meta["layout"][k] for k in ("engine", "dp", "tp", "pp")} == {"engine": "KerasGPTEngine", "dp": 2,
                                                                           "tp": 2, "pp": 2}
