"""phalanx's one AdamW apply (optim.apply_adamw) against an independent NumPy AdamW.

The reference is a plain loop over Loshchilov & Hutter 2019, Algorithm 2 (AdamW), with the
schedule multiplier eta_t = lr_t and alpha = 1 (as phalanx and PyTorch define ``lr``):

    g_t = factor * grad_t
    m_t = beta1 m_{t-1} + (1 - beta1) g_t,   v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
    m^_t = m_t / (1 - beta1^t),              v^_t = v_t / (1 - beta2^t)
    theta_t = theta_{t-1} - eta_t (alpha m^_t / (sqrt(v^_t) + eps) + lambda theta_{t-1})

computed in float64 from the same float32 inputs; phalanx's float32 result must match to
rtol 1e-6, relative to the size of the terms each update adds (where theta - eta_t u or
beta1 m + (1 - beta1) g cancel to almost zero, no float32 computation of them can be
closer than a few float32 ulps of the terms, ~1e-7 of them). Also: a non-finite step changes nothing, a mask keeps pruned entries at zero,
and the engine that uses phalanx's AdamW (the Keras-model engine's PhalanxAdamW, a Keras
optimizer) goes through the one apply.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from phalanx.config import TrainConfig
from phalanx.core import optim


def reference_adamw(theta, m, v, grads, lrs, factors, cfg: TrainConfig, decay: bool, first_step: int = 1):
    """``(theta, m, v)`` after the steps, and for each the largest magnitude of the terms
    summed into it (the scale of float32 rounding)."""
    theta, m, v = (np.asarray(a, np.float64).copy() for a in (theta, m, v))
    scales = [np.abs(theta), np.abs(m), np.abs(v)]
    # the hyperparameters as the float32 numbers phalanx computes with (1 - beta2 of
    # float32(0.95) differs from 0.05 by 2.4e-7, relative)
    b1, b2, eps, lam = (float(np.float32(x)) for x in (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay))
    lam = lam if decay else 0.0
    for i, (grad, lr, factor) in enumerate(zip(grads, lrs, factors)):
        t = first_step + i
        g = factor * np.asarray(grad, np.float64)
        m_terms = (b1 * m, (1.0 - b1) * g)
        v_terms = (b2 * v, (1.0 - b2) * g * g)
        m, v = sum(m_terms), sum(v_terms)
        m_hat = m / (1.0 - b1 ** t)
        v_hat = v / (1.0 - b2 ** t)
        step = lr * (m_hat / (np.sqrt(v_hat) + eps) + lam * theta)
        scales = [np.maximum(scales[0], np.abs(theta) + np.abs(step)),
                  np.maximum(scales[1], sum(np.abs(x) for x in m_terms)),
                  np.maximum(scales[2], sum(np.abs(x) for x in v_terms))]
        theta = theta - step
    return (theta, m, v), scales


def assert_matches(got, want, scales, names=("param", "m", "v"), rtol=1e-6):
    for name, g, w, scale in zip(names, got, want, scales):
        assert g.dtype == np.float32
        err = np.abs(g.astype(np.float64) - w)
        bound = rtol * np.maximum(np.abs(w), scale)
        worst = np.argmax(err / bound)
        assert np.all(err <= bound), (f"{name}: |phalanx - reference| = {err.flat[worst]:.3g} > {bound.flat[worst]:.3g} "
                                      f"(value {w.flat[worst]:.6g}, term scale {scale.flat[worst]:.6g})")


def run_phalanx(theta, m, v, grads, lrs, factors, cfg, decay, first_step=1, finite=True, mask=None):
    var, mv, vv = tf.Variable(theta), tf.Variable(m), tf.Variable(v)
    mask_var = None if mask is None else tf.Variable(mask)

    @tf.function
    def step(grad, t, lr, factor):
        optim.apply_adamw(var, mv, vv, grad, step=t, lr=lr, factor=factor, finite=tf.constant(finite),
                          cfg=cfg, decay=decay, mask=mask_var)

    for i, (grad, lr, factor) in enumerate(zip(grads, lrs, factors)):
        step(tf.constant(grad), tf.constant(first_step + i, tf.int64), tf.constant(lr, tf.float32),
             tf.constant(factor, tf.float32))
    return var.numpy(), mv.numpy(), vv.numpy()


def random_case(seed, shape=(64, 33), steps=5):
    rng = np.random.default_rng(seed)
    theta = rng.standard_normal(shape).astype(np.float32) * 0.05
    m = rng.standard_normal(shape).astype(np.float32) * 1e-3
    v = np.abs(rng.standard_normal(shape)).astype(np.float32) * 1e-5
    grads = [rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.uniform(-4, -1) for _ in range(steps)]
    lrs = [float(np.float32(x)) for x in rng.uniform(1e-5, 3e-3, steps)]
    factors = [float(np.float32(x)) for x in rng.uniform(0.2, 1.0, steps)]
    return theta, m, v, grads, lrs, factors


@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("first_step", [1, 7, 1000])
def test_apply_adamw_matches_the_reference(decay, first_step):
    cfg = TrainConfig(weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    case = random_case(first_step + decay)
    want, scales = reference_adamw(*case, cfg, decay, first_step)
    assert_matches(run_phalanx(*case, cfg, decay, first_step), want, scales)


def test_apply_adamw_other_hyperparameters():
    cfg = TrainConfig(weight_decay=0.01, beta1=0.8, beta2=0.999, eps=1e-6)
    case = random_case(3, shape=(257,), steps=3)
    want, scales = reference_adamw(*case, cfg, True, 2)
    assert_matches(run_phalanx(*case, cfg, True, 2), want, scales)


def test_non_finite_step_changes_nothing_and_mask_keeps_zeros():
    cfg = TrainConfig()
    theta, m, v, grads, lrs, factors = random_case(5, steps=1)
    got = run_phalanx(theta, m, v, grads, lrs, factors, cfg, True, finite=False)
    for before, after in zip((theta, m, v), got):
        np.testing.assert_array_equal(after, before)
    mask = (np.random.default_rng(0).random(theta.shape) > 0.5).astype(np.float32)
    got = run_phalanx(theta * mask, m * mask, v * mask, grads, lrs, factors, cfg, True, mask=mask)
    want, scales = reference_adamw(theta * mask, m * mask, v * mask, grads, lrs, factors, cfg, True)
    for g in got:
        assert np.all(g[mask == 0] == 0)
    keep = mask == 1
    assert_matches([g[keep] for g in got], [w[keep] for w in want], [s[keep] for s in scales])


def test_every_engine_uses_the_one_apply():
    from phalanx.engines import keras_gpt

    assert not hasattr(optim, "adamw_update")  # the tensor-op version is gone
    assert "optim.apply_adamw(" in inspect.getsource(keras_gpt.PhalanxAdamW.apply)


def test_apply_adamw_is_one_xla_kernel_per_variable():
    """The update reads and writes var, m and v in one compiled kernel (no separate decay
    multiply, gradient scaling or mask pass); skipped when XLA kernels are switched off."""
    from phalanx.core.xla import XLA_KERNELS

    if not XLA_KERNELS:
        pytest.skip("PHALANX_XLA_KERNELS=0")
    cfg = TrainConfig(weight_decay=0.1)
    variables = [tf.Variable(tf.zeros(shape)) for shape in ((4, 3), (4, 3), (7,))]
    slots = [(tf.Variable(tf.zeros(v.shape)), tf.Variable(tf.zeros(v.shape))) for v in variables]

    @tf.function
    def step():
        scalars = optim.adamw_scalars(tf.constant(1), 1e-3, 1.0, tf.constant(True), cfg)
        for var, (m, v) in zip(variables, slots):
            optim.apply_adamw(var, m, v, tf.ones(var.shape), cfg=cfg, decay=True, scalars=scalars)

    ops = step.get_concrete_function().graph.get_operations()
    compiled = [op for op in ops if op.type in ("PartitionedCall", "StatefulPartitionedCall")
                and op.get_attr("_XlaMustCompile")]
    assert len(compiled) == len(variables)
    assert not [op.type for op in ops if op.type.startswith(("ResourceApply", "AssignVariable"))]
    # outside the kernels only the step's scalars are computed
    assert all(out.shape.rank == 0 for op in ops if op.type in ("Mul", "Sub", "AddV2", "Cast") for out in op.outputs)
