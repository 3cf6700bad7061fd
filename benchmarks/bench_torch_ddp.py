"""phalanx ``multi_worker`` beside PyTorch ``DistributedDataParallel``: same GPT, same data, same optimizer.

Issue 14, item 4. For each precision (float32, mixed_bfloat16) and process count (1, 2) it trains

* **phalanx**: ``phalanx train`` (one process; OneDeviceStrategy), or ``phalanx launch --workers 2 --
  phalanx train parallel.strategy=multi_worker`` (two processes, MultiWorkerMirroredStrategy, ring
  all-reduce over gRPC on 127.0.0.1 in the launcher's private network namespace), exactly as a user runs
  it: the trainer's own loop, input pipeline and ``metrics.jsonl`` (``train.log_every=1``);
* **PyTorch**: the same GPT written in plain idiomatic PyTorch (``nn.Linear``, ``nn.LayerNorm``,
  ``F.scaled_dot_product_attention(is_causal=True)``, tanh GELU, tied embedding), eager mode,
  ``torch.optim.AdamW`` (default implementation) with two parameter groups, ``clip_grad_norm_``,
  ``LambdaLR``; two processes under ``DistributedDataParallel`` (gloo, ``init_method`` on
  tcp://127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``, a bounded ``timeout``), in a private network namespace
  of the same kind when the OS allows it (only ``lo``); bfloat16 through
  ``torch.autocast("cpu", dtype=torch.bfloat16)``.

**Same model, same start, same data.** The shapes are phalanx's GPT (``ModelConfig``'s defaults, which
are the demo's: 4 layers, d_model 256, 4 heads, ffn 1024, byte vocabulary 256, seq_len 128, global batch
16 = 2,048 tokens a step; pre-LN, tanh GELU, tied input/output embedding, learned positions, LayerNorm eps
1e-5). A helper process (``--export``) builds phalanx's own input pipeline
(:func:`phalanx.data.pipeline.make_datasets` on the stdlib corpus, byte tokenizer: the examples and the
per-step shuffle phalanx trains on) and saves the first ``--steps`` global batches and the first
``--eval-batches`` held-out batches as int32 arrays, and phalanx's seeded initial weights
(:func:`phalanx.models.gpt.initial_weights`, the GPT-2 scheme: N(0, 0.02), residual projections / sqrt(2L)).
PyTorch loads both: it starts from bit-identical float32 weights and trains on the very token batches
phalanx reads at each step (rank r of 2 takes rows ``[r*8, r*8+8)`` of global batch k, as phalanx's worker
r does). Both take AdamW with phalanx's hyperparameters (lr, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
the matmul kernels and the token embedding only, global-norm clipping 1.0, linear warm-up then cosine to
0.1 x lr), read from phalanx's ``TrainConfig``.

**What is reported** per run: tokens/s (global batch x seq_len / the median step time over the steps after
the first ``--skip``; the step is timed on rank / worker 0, data fetch and loss read-back included), the
training loss at step 1 (same weights, same batch: the two systems should agree to float32/bfloat16
rounding), the mean training loss over the last 10 steps, and the held-out loss after the last step on the
same ``--eval-batches`` batches, i.e. after the same number of tokens on the same data. Also the child
processes' CPU seconds and the 1-minute load average sampled during the run.

**Threads.** "match" (the default for every run): each process keeps TensorFlow's defaults (intra- and
inter-op pools of ``os.cpu_count()`` threads; oneDNN on: ``TF_ENABLE_ONEDNN_OPTS=1``) and PyTorch gets
``torch.set_num_threads(os.cpu_count())``, which is also PyTorch's own default. With 2 processes on a
2-core machine that is 2 x 2 compute threads on 2 cores. "split" (``--threads match,split``, the default
adds it for 2 processes): 1 compute thread a process for both systems (``TF_NUM_INTRAOP_THREADS=1``,
``torch.set_num_threads(1)``, what ``torchrun`` sets by default for several processes a node). "one"
(``--threads one``, not in the default): 1 compute thread a process whatever the process count, the
comparison least disturbed by other load (no thread waits for a descheduled sibling).

The run order alternates the two systems within every (precision, processes, threads) cell so both see
the same load. Ratios within one run are what to trust on a shared machine.

Install the benchmark-only extra (never a runtime dependency of phalanx) with the CPU wheel::

    pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e '.[bench-torch]'

Usage::

    python benchmarks/bench_torch_ddp.py                       # full run (bounded to ~15 min), writes
                                                               # benchmarks/results/torch_ddp_<date>.{md,json}
    python benchmarks/bench_torch_ddp.py --steps 10 --skip 2 --threads match --output -   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machine_report import lscpu  # benchmarks/ is on sys.path when run as a script

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
POLICIES = ("float32", "mixed_bfloat16")
LAST_K = 10  # training-loss window at the end of the run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40,
                   help="optimizer steps per run (default 40; the 12 runs took 28 min at a load of 7-11 on 2 cores, "
                        "which --budget-min bounds)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the timing (default 5)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all processes")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=-1, help="warm-up steps (default: steps // 10)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out global batches evaluated at the end")
    p.add_argument("--precisions", default=",".join(POLICIES), help="comma list of float32, mixed_bfloat16")
    p.add_argument("--procs", default="1,2", help="comma list of process counts (default 1,2)")
    p.add_argument("--systems", default="torch,phalanx", help="comma list of torch, phalanx")
    p.add_argument("--threads", default="match,split",
                   help="comma list of match (TF's default pools; torch threads = cpu count), split "
                        "(cpu count / processes a process, both systems) and one (1 a process); a setting "
                        "that gives the same thread count as an earlier one is not run again")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run is stopped (default 600)")
    p.add_argument("--budget-min", type=float, default=13.0,
                   help="start no new run after this many minutes; the rest are reported as skipped (default 13; "
                        "the split-thread runs come last)")
    p.add_argument("--phalanx-src", choices=("head", "worktree"), default="head",
                   help="head (default): benchmark the committed phalanx (git archive HEAD src, put first on "
                        "PYTHONPATH for every phalanx process), so edits in progress cannot change a run halfway; "
                        "worktree: the checked-out files as they are")
    p.add_argument("--output", default="",
                   help="path of the .md report (a .json is written beside it); default "
                        "benchmarks/results/torch_ddp_<date>.md; '-' writes nothing")
    # internal modes
    p.add_argument("--export", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--torch-worker", metavar="JSON", help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------------------
# Shared settings


def phalanx_overrides(args, policy: str, steps: int) -> list[str]:
    """The phalanx config of every run (the export uses the same keys, so data and weights agree)."""
    return [
        f"model.layers={args.layers}", f"model.d_model={args.d_model}", f"model.heads={args.heads}",
        f"model.ffn={args.ffn}", "model.vocab=256", f"model.seq_len={args.seq_len}", "model.dropout=0.0",
        "model.tie_embeddings=true", "data.source=stdlib", "data.tokenizer=bytes",
        f"train.global_batch={args.global_batch}", f"train.steps={steps}", f"train.warmup={args.warmup}",
        f"train.lr={args.lr}", "train.seed=0", "train.grad_accum=1", "train.log_every=1",
        f"train.eval_every={steps}", f"train.eval_batches={args.eval_batches}",
        # MFU is not used here: a fixed peak skips the matmul probe at start-up.
        "train.peak_flops=1e12", "checkpoint.every=0", f"precision.policy={policy}",
    ]


PHALANX_SRC: str | None = None  # set by the orchestrator: the snapshot of src/ every phalanx process imports


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    if PHALANX_SRC:
        env["PYTHONPATH"] = os.pathsep.join([PHALANX_SRC] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONUNBUFFERED="1")
    for key in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS", "TF_CONFIG"):
        env.pop(key, None)
    return env


# ---------------------------------------------------------------------------
# --export: phalanx's data and initial weights, as arrays (TensorFlow runs here only)


def export_main(args) -> int:
    os.environ.update(TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    import numpy as np
    import tensorflow as tf
    import keras

    from phalanx.config import load_config
    from phalanx.data.pipeline import make_datasets
    from phalanx.models.gpt import initial_weights, num_params
    from phalanx.core.costs import gpt_training_flops_per_token

    out = Path(args.export)
    if args.warmup < 0:
        args.warmup = max(1, args.steps // 10)
    cfg = load_config(None, phalanx_overrides(args, "float32", args.steps))
    ds = make_datasets(cfg, 0, 1, progress=False)
    it = ds.train_iterator(0)
    train = np.stack([next(it).numpy() for _ in range(args.steps)]).astype(np.int32)
    val = []
    for i, b in enumerate(ds.val):
        if i >= args.eval_batches:
            break
        val.append(b.numpy())
    val = np.stack(val).astype(np.int32)
    weights = initial_weights(cfg.model, cfg.train.seed)
    np.savez(out / "data.npz", train=train, val=val, **{f"w:{k}": v for k, v in weights.items()})
    try:
        from tensorflow.python.util import _pywrap_util_port
        onednn_enabled = bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # noqa: BLE001 - private API; recorded as unknown
        onednn_enabled = None
    t = cfg.train
    meta = {
        "tensorflow": tf.__version__, "keras": keras.__version__,
        "tf_onednn_enabled": onednn_enabled, "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "tf_intra_op_threads_setting": tf.config.threading.get_intra_op_parallelism_threads(),
        "tf_inter_op_threads_setting": tf.config.threading.get_inter_op_parallelism_threads(),
        "model": {"layers": cfg.model.layers, "d_model": cfg.model.d_model, "heads": cfg.model.heads,
                  "ffn": cfg.model.ffn_dim, "vocab": cfg.model.vocab, "seq_len": cfg.model.seq_len,
                  "tie_embeddings": cfg.model.tie_embeddings},
        "params": num_params(cfg.model),
        "flops_per_token": gpt_training_flops_per_token(cfg.model),
        "train": {"lr": t.lr, "warmup": t.warmup, "steps": t.steps, "min_lr_ratio": t.min_lr_ratio,
                  "clip_norm": t.clip_norm, "weight_decay": t.weight_decay, "beta1": t.beta1, "beta2": t.beta2,
                  "eps": t.eps, "global_batch": t.global_batch, "seed": t.seed},
        "data": {"dir": str(ds.directory), "train_examples": ds.num_train_examples,
                 "val_examples": ds.num_val_examples, "tokenizer": ds.tokenizer.name,
                 "vocab_size": ds.vocab_size},
        "train_shape": list(train.shape), "val_shape": list(val.shape),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return 0


# ---------------------------------------------------------------------------
# --torch-worker: one DDP rank (or the single process)


def torch_worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    rank, world, threads = spec["rank"], spec["world"], spec["threads"]
    torch.set_num_threads(threads)
    meta = json.loads(Path(spec["meta"]).read_text())
    m, t = meta["model"], meta["train"]
    d, heads, ffn, vocab, seq = m["d_model"], m["heads"], m["ffn"], m["vocab"], m["seq_len"]
    bf16 = spec["policy"] == "mixed_bfloat16"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, ffn), nn.Linear(ffn, d)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, s, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
            return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(m["layers"]))
            self.ln_f = nn.LayerNorm(d, eps=1e-5)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied embedding

    data = np.load(spec["data"])
    model = GPT()
    w = {k[2:]: v for k, v in data.items() if k.startswith("w:")}
    sd = {"wte.weight": w["embed/tokens"], "wpe.weight": w["embed/positions"],
          "ln_f.weight": w["final_ln/gamma"], "ln_f.bias": w["final_ln/beta"]}
    for i in range(m["layers"]):
        p = f"block_{i}/"
        for ours, theirs in (("ln1/gamma", "ln1.weight"), ("ln1/beta", "ln1.bias"), ("ln2/gamma", "ln2.weight"),
                             ("ln2/beta", "ln2.bias"), ("attn/qkv/bias", "qkv.bias"), ("attn/out/bias", "out.bias"),
                             ("mlp/fc/bias", "fc.bias"), ("mlp/proj/bias", "proj.bias")):
            sd[f"blocks.{i}.{theirs}"] = w[p + ours]
        for ours, theirs in (("attn/qkv/kernel", "qkv.weight"), ("attn/out/kernel", "out.weight"),
                             ("mlp/fc/kernel", "fc.weight"), ("mlp/proj/kernel", "proj.weight")):
            sd[f"blocks.{i}.{theirs}"] = w[p + ours].T  # phalanx kernels are [in, out]
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    n_params = sum(p.numel() for p in model.parameters())

    # AdamW decay as phalanx: matmul kernels and the token embedding; not positions, biases, LayerNorm.
    decay = [p for n, p in model.named_parameters() if n == "wte.weight" or (n.endswith(".weight") and p.dim() == 2
                                                                             and n != "wpe.weight")]
    ids = {id(p) for p in decay}
    no_decay = [p for p in model.parameters() if id(p) not in ids]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"])

    def lr_factor(step: int) -> float:  # phalanx.core.optim.learning_rate / peak
        if step < t["warmup"]:
            return (step + 1.0) / max(t["warmup"], 1)
        progress = min(max((step - t["warmup"]) / max(t["steps"] - t["warmup"], 1), 0.0), 1.0)
        return t["min_lr_ratio"] + 0.5 * (1 - t["min_lr_ratio"]) * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    if world > 1:
        import datetime as _dt
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                                world_size=world, timeout=_dt.timedelta(seconds=spec["timeout"]))
        ddp = nn.parallel.DistributedDataParallel(model)
    else:
        ddp = model

    train = torch.from_numpy(data["train"]).long()
    val = torch.from_numpy(data["val"]).long()
    rows = train.shape[1] // world
    steps = train.shape[0]
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else (lambda: torch.autocast("cpu", enabled=False))
    times, losses, cpu = [], [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = train[step, rank * rows:(rank + 1) * rows]
        x, y = batch[:, :-1], batch[:, 1:]
        with ctx():
            logits = ddp(x)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["clip_norm"])
        opt.step()
        sched.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    local = torch.tensor(losses, dtype=torch.float64)
    if world > 1:  # the global-batch mean loss of every step (one all-reduce at the end, outside the timing)
        dist.all_reduce(local)
        local /= world
    eval_loss = None
    if rank == 0:
        model.eval()
        with torch.no_grad(), ctx():
            ev = [F.cross_entropy(model(b[:, :-1]).float().reshape(-1, vocab), b[:, 1:].reshape(-1)).item()
                  for b in val]
        eval_loss = float(np.mean(ev))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        result = {"step_times": times, "step_cpu": cpu, "losses": local.tolist(), "eval_loss": eval_loss,
                  "params": n_params, "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "interop_threads": torch.get_num_interop_threads(),
                  "mkldnn": bool(torch.backends.mkldnn.is_available()),
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "ddp": world > 1, "backend": "gloo" if world > 1 else None}
        Path(spec["out"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------
# The orchestrator (imports neither TensorFlow nor PyTorch)


class LoadSampler:
    """Samples the 1-minute load average every ``every`` seconds in a thread."""

    def __init__(self, every: float = 2.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "mean": statistics.fmean(s), "max": max(s)}


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_procs(cmds: list[list[str]], envs: list[dict], logs: list[Path], timeout: float,
              preexec=None) -> tuple[int, bool]:
    """Start every command in its own session; wait up to ``timeout``; on time-out or a failure kill the
    ones still running (by their own process groups). Returns (worst exit code, timed out)."""
    procs = []
    for cmd, env, log in zip(cmds, envs, logs):
        fh = open(log, "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=preexec), fh))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p, _ in procs):
                break
            time.sleep(0.2)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 10
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < end:
            time.sleep(0.1)
        for p, fh in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            fh.close()
    codes = [p.returncode for p, _ in procs]
    return max(codes, key=abs), timed_out


def threads_for(mode: str, procs: int) -> int:
    """Compute threads a process: match = os.cpu_count() (TensorFlow's and PyTorch's default), split =
    cpu count / processes, one = 1."""
    cores = os.cpu_count() or 1
    return {"match": cores, "split": max(1, cores // procs), "one": 1}[mode]


def phalanx_command() -> list[str]:
    exe = Path(sys.executable).with_name("phalanx")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "phalanx.cli"]


class Bench:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.meta: dict = {}
        self.net = None  # phalanx.cluster.netns.PrivateNetwork for the torch DDP ranks
        self.net_note = ""

    def export(self) -> None:
        out = self.work / "export"
        out.mkdir()
        code, timed_out = run_procs([[sys.executable, __file__, "--export", str(out), *self._shape_args()]],
                                    [base_env()], [self.work / "export.log"], self.args.run_timeout)
        if code or timed_out:
            sys.exit(f"export failed ({'timed out' if timed_out else f'status {code}'}); see "
                     f"{self.work / 'export.log'}:\n{(self.work / 'export.log').read_text()[-3000:]}")
        self.meta = json.loads((out / "meta.json").read_text())
        self.data = out / "data.npz"

    def _shape_args(self) -> list[str]:
        a = self.args
        return ["--steps", str(a.steps), "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads",
                str(a.heads), "--ffn", str(a.ffn), "--seq-len", str(a.seq_len), "--global-batch",
                str(a.global_batch), "--lr", str(a.lr), "--warmup", str(a.warmup), "--eval-batches",
                str(a.eval_batches)]

    def private_network(self):
        """The torch ranks join a private network namespace (only lo), as phalanx launch's tasks do."""
        if self.net is None and not self.net_note:
            try:
                from phalanx.cluster.netns import PrivateNetwork
                self.net = PrivateNetwork.create()
                self.net_note = self.net.describe()
            except (OSError, ImportError) as err:
                self.net_note = f"host network, loopback only ({err})"
        return self.net

    def run(self, system: str, procs: int, threads: str, policy: str) -> dict:
        tag = f"{system}-p{procs}-{threads}-{policy}"
        rundir = self.work / tag
        rundir.mkdir()
        nthreads = threads_for(threads, procs)
        load0, cpu0, t0 = os.getloadavg(), children_cpu(), time.perf_counter()
        with LoadSampler() as sampler:
            if system == "torch":
                result = self._run_torch(rundir, procs, nthreads, policy)
            else:
                result = self._run_phalanx(rundir, procs, threads, policy)
        result.update(system=system, procs=procs, threads_mode=threads, threads_per_proc=nthreads, policy=policy,
                      wall_s=time.perf_counter() - t0, cpu_s=children_cpu() - cpu0, load_before=load0,
                      load_after=os.getloadavg(), load_during=sampler.summary())
        if result.get("ok"):
            self._summarise(result)
            print(f"[bench] {tag}: {result['tokens_per_s']:,.0f} tokens/s, step-1 loss {result['loss_step1']:.4f}, "
                  f"last-{LAST_K} loss {result['loss_last']:.4f}, eval {result['eval_loss']:.4f}, "
                  f"wall {result['wall_s']:.0f} s, load {result['load_during']['mean']:.2f}", file=sys.stderr,
                  flush=True)
        else:
            print(f"[bench] {tag}: FAILED ({result.get('error')})", file=sys.stderr, flush=True)
        return result

    def _run_torch(self, rundir: Path, procs: int, nthreads: int, policy: str) -> dict:
        port = free_port()
        cmds, envs, logs = [], [], []
        out = rundir / "result.json"
        env = base_env()
        env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for rank in range(procs):
            spec = {"rank": rank, "world": procs, "threads": nthreads, "policy": policy, "port": port,
                    "timeout": int(self.args.run_timeout), "data": str(self.data),
                    "meta": str(self.data.with_name("meta.json")), "out": str(out)}
            spec_path = rundir / f"spec{rank}.json"
            spec_path.write_text(json.dumps(spec))
            cmds.append([sys.executable, __file__, "--torch-worker", str(spec_path)])
            envs.append(dict(env, OMP_NUM_THREADS=str(nthreads)))
            logs.append(rundir / f"rank{rank}.log")
        net = self.private_network() if procs > 1 else None
        code, timed_out = run_procs(cmds, envs, logs, self.args.run_timeout,
                                    preexec=net.join if net is not None else None)
        if code or timed_out or not out.exists():
            return {"ok": False, "error": "timed out" if timed_out else f"status {code}",
                    "log_tail": "\n".join(log.read_text()[-2000:] for log in logs)}
        r = json.loads(out.read_text())
        r.update(ok=True, network=self.net_note if procs > 1 else None)
        return r

    def _run_phalanx(self, rundir: Path, procs: int, threads: str, policy: str) -> dict:
        a = self.args
        train = [*phalanx_command(), "train", "--quiet", *phalanx_overrides(a, policy, a.steps),
                 f"run.dir={rundir / 'run'}"]
        env = base_env()
        if threads != "match":
            env["TF_NUM_INTRAOP_THREADS"] = str(threads_for(threads, procs))
        if procs > 1:
            cmd = [*phalanx_command(), "launch", "--workers", str(procs), "--timeout", str(a.run_timeout), "--",
                   *train, "parallel.strategy=multi_worker"]
        else:
            cmd = train
        log = rundir / "phalanx.log"
        code, timed_out = run_procs([cmd], [env], [log], a.run_timeout + 30)
        metrics = rundir / "run" / "metrics.jsonl"
        if code or timed_out or not metrics.exists():
            return {"ok": False, "error": "timed out" if timed_out else f"status {code}",
                    "log_tail": log.read_text()[-3000:]}
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        text = log.read_text()
        if procs > 1 and f"worker:{procs - 1}" not in text:
            return {"ok": False, "error": f"the launcher did not start {procs} workers", "log_tail": text[-3000:]}
        network = next((line.split("network: ", 1)[1] for line in text.splitlines() if "[launch] network:" in line),
                       None)
        if procs > 1 and network is None:
            network = "host network (see log)" if "WARNING" in text else None
        return {"ok": True, "step_times": [r["step_time_s"] for r in rows], "losses": [r["loss"] for r in rows],
                "eval_loss": next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None),
                "params": self.meta["params"], "network": network,
                "strategy": "MultiWorkerMirroredStrategy" if procs > 1 else "OneDeviceStrategy"}

    def _summarise(self, r: dict) -> None:
        skip = min(self.args.skip, len(r["step_times"]) - 1)
        timed = r["step_times"][skip:]
        tokens = self.args.global_batch * self.args.seq_len
        r["median_step_s"] = statistics.median(timed)
        r["tokens_per_s"] = tokens / r["median_step_s"]
        r["tokens_per_s_mean"] = tokens * len(timed) / sum(timed)
        r["tokens_per_s_best"] = tokens / min(timed)  # the fastest step: the least disturbed by other load
        r["loss_step1"] = r["losses"][0]
        r["loss_last"] = statistics.fmean(r["losses"][-LAST_K:])
        r["loss_final"] = r["losses"][-1]
        r["timed_steps"] = len(timed)


def find_any(runs: list[dict], threads: str) -> bool:
    return any(r["threads_mode"] == threads for r in runs)


def fmt_load(values) -> str:
    return "/".join(f"{x:.2f}" for x in values)


def machine_info() -> dict:
    fields = lscpu()
    flags = fields.get("Flags", "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    return {"model": fields.get("Model name", "unknown"), "cores": os.cpu_count(),
            "cpu_family": fields.get("CPU family"), "cpu_model": fields.get("Model"),
            "hypervisor": fields.get("Hypervisor vendor"),
            "key_flags": [f for f in wanted if f in flags],
            "missing_flags": [f for f in wanted if f not in flags], "flags": flags}


def snapshot_source(mode: str, work: Path) -> dict:
    """Which phalanx the runs import; with ``head`` a copy of the committed ``src/`` (see --phalanx-src)."""
    global PHALANX_SRC
    repo = HERE.parent

    def git(*cmd) -> str:
        return subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD")
    dirty = len([line for line in git("status", "--porcelain", "--", "src").splitlines() if line.strip()])
    if mode == "head" and commit:
        target = work / "phalanx_head"
        target.mkdir()
        archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD", "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
        PHALANX_SRC = str(target / "src")
        sys.path.insert(0, PHALANX_SRC)
        return {"mode": "head", "commit": commit, "note": f"committed src/ at {commit[:10]} "
                f"({dirty} uncommitted change(s) under src/ in the work tree were not used)"}
    return {"mode": "worktree", "commit": commit, "note": f"the work tree's src/ on {commit[:10]} with {dirty} "
            "uncommitted change(s) under src/"}


def orchestrate(args) -> int:
    if args.warmup < 0:
        args.warmup = max(1, args.steps // 10)
    if args.steps <= args.skip + 1:
        sys.exit(f"--steps {args.steps} must exceed --skip {args.skip} + 1")
    if args.global_batch % 2:
        sys.exit("--global-batch must be even (it is split over 2 processes)")
    precisions = [p for p in args.precisions.split(",") if p]
    procs_list = [int(p) for p in args.procs.split(",") if p]
    systems = [s for s in args.systems.split(",") if s]
    thread_modes = [t for t in args.threads.split(",") if t]
    bad = ([p for p in precisions if p not in POLICIES] + [s for s in systems if s not in ("torch", "phalanx")]
           + [t for t in thread_modes if t not in ("match", "split", "one")] + [str(p) for p in procs_list if p < 1])
    if bad:
        sys.exit(f"unknown values: {bad}")
    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_info()
    work = Path(tempfile.mkdtemp(prefix="bench_torch_ddp_"))
    phalanx_src = snapshot_source(args.phalanx_src, work)
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t_start = time.monotonic()
    bench = Bench(args, work)
    results, cell, planned = [], 0, set()
    try:
        print(f"[bench] exporting phalanx's batches and initial weights ({work})", file=sys.stderr, flush=True)
        bench.export()
        for threads in thread_modes:  # match first: the split runs are the ones a budget cut-off drops
            for policy in precisions:
                for procs in procs_list:
                    if (policy, procs, threads_for(threads, procs)) in planned:
                        continue  # e.g. split with one process is match
                    planned.add((policy, procs, threads_for(threads, procs)))
                    order = systems if cell % 2 == 0 else systems[::-1]
                    cell += 1
                    for system in order:
                        if time.monotonic() - t_start > 60 * args.budget_min:
                            results.append({"system": system, "procs": procs, "threads_mode": threads,
                                            "policy": policy, "ok": False, "skipped": True,
                                            "error": "skipped: --budget-min reached"})
                            continue
                        results.append(bench.run(system, procs, threads, policy))
    finally:
        if bench.net is not None:
            bench.net.close()
    elapsed = time.monotonic() - t_start
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    failed = [r for r in results if not r.get("ok") and not r.get("skipped")]
    skipped = [r for r in results if r.get("skipped")]
    if skipped:
        print(f"[bench] {len(skipped)} run(s) skipped: --budget-min {args.budget_min:g} reached", file=sys.stderr)
    if failed:
        print(f"[bench] {len(failed)} run(s) failed; logs kept in {work}", file=sys.stderr)
        for r in failed:
            print(f"--- {r['system']} p{r['procs']} {r['threads_mode']} {r['policy']}: {r.get('error')}\n"
                  f"{r.get('log_tail', '')[-1500:]}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    report = {"started_utc": started.isoformat(timespec="seconds"), "elapsed_s": elapsed,
              "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
              "uptime_before": uptime_before, "uptime_after": uptime_after, "machine": machine,
              "phalanx_side": bench.meta, "phalanx_source": phalanx_src, "args": vars(args), "torch_network": bench.net_note, "runs": results}
    md = render(report)
    print(md)
    if args.output != "-":
        path = Path(args.output) if args.output else RESULTS / f"torch_ddp_{started.date().isoformat()}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(md)
        slim = dict(report, machine={k: v for k, v in machine.items() if k != "flags"},
                    runs=[{k: v for k, v in r.items() if k != "log_tail"} for r in results])
        path.with_suffix(".json").write_text(json.dumps(slim, indent=1))
        print(f"[bench] wrote {path} and {path.with_suffix('.json')}", file=sys.stderr)
    return 1 if failed else 0


def render(rep: dict) -> str:
    a, meta, mach = rep["args"], rep["phalanx_side"], rep["machine"]
    runs = [r for r in rep["runs"] if r.get("ok")]
    torch_info = next((r for r in runs if r["system"] == "torch"), {})
    m = meta.get("model", {})
    t = meta.get("train", {})
    tokens = a["global_batch"] * a["seq_len"]
    lines = [
        "# phalanx multi_worker vs PyTorch DistributedDataParallel (CPU)",
        "",
        f"Written by `{rep['command']}`, started {rep['started_utc']}, {rep['elapsed_s'] / 60:.1f} min in all.",
        "",
        f"- phalanx: {rep['phalanx_source']['note']}.",
        f"- Machine: {mach['model']} (family {mach['cpu_family']}, model {mach['cpu_model']}, "
        f"{mach['hypervisor'] or 'no'} hypervisor), {mach['cores']} cores; has {', '.join(mach['key_flags'])}; "
        f"lacks {', '.join(mach['missing_flags']) or 'none'}.",
        f"- Load: `{rep['uptime_before']}` before, `{rep['uptime_after']}` after (the benchmark's own processes "
        "count in the load; 2 busy processes make ~2).",
        f"- TensorFlow {meta.get('tensorflow')}, Keras {meta.get('keras')}: TF_ENABLE_ONEDNN_OPTS="
        f"{meta.get('TF_ENABLE_ONEDNN_OPTS')} (oneDNN enabled: {meta.get('tf_onednn_enabled')}), intra/inter-op "
        f"pools at TensorFlow's default ({mach['cores']} threads each; "
        "`TF_NUM_INTRAOP_THREADS` in the split and one runs).",
        f"- PyTorch {torch_info.get('torch')} (CPU wheel; oneDNN/mkldnn {torch_info.get('mkldnn')}, "
        f"CPU capability {torch_info.get('cpu_capability')}), eager, `torch.set_num_threads` as in the table; "
        f"DDP over gloo, init tcp://127.0.0.1, {rep.get('torch_network') or 'n/a'}.",
        f"- Model: GPT {m.get('layers')} layers, d_model {m.get('d_model')}, {m.get('heads')} heads, ffn "
        f"{m.get('ffn')}, vocab {m.get('vocab')} (bytes), seq_len {m.get('seq_len')}, tied embedding; "
        f"{meta.get('params', 0):,} parameters; global batch {a['global_batch']} ({tokens:,} tokens a step).",
        f"- Data: phalanx's stdlib corpus ({meta.get('data', {}).get('train_examples', 0):,} training examples), "
        f"{a['steps']} global batches exported from phalanx's pipeline and fed to both; held-out loss on "
        f"{a['eval_batches']} of phalanx's validation batches after the last step.",
        f"- AdamW lr {t.get('lr')}, betas {t.get('beta1')}/{t.get('beta2')}, eps {t.get('eps')}, weight decay "
        f"{t.get('weight_decay')} (kernels + token embedding), clip {t.get('clip_norm')}, warm-up {t.get('warmup')} "
        f"then cosine to {t.get('min_lr_ratio')} x lr over {t.get('steps')} steps; the same initial weights.",
        f"- tokens/s = {tokens:,} / median step time over steps {a['skip'] + 1}-{a['steps']} (worker/rank 0). "
        f"Loss: step 1, mean of the last {LAST_K} steps, held-out after step {a['steps']} "
        f"({a['steps'] * tokens:,} tokens).",
        "",
        "| system | processes | threads / process | precision | tokens/s | mean-based tokens/s | best-step tokens/s | "
        "step-1 loss | "
        f"last-{LAST_K} loss | held-out loss | CPU s, all processes, whole run | load during (min-max) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["runs"]:
        label = "phalanx" if r["system"] == "phalanx" else "PyTorch DDP" if r["procs"] > 1 else "PyTorch"
        if r["system"] == "phalanx" and r["procs"] > 1:
            label = "phalanx multi_worker"
        if not r.get("ok"):
            what = r.get("error") if r.get("skipped") else f"failed: {r.get('error')}"
            lines.append(f"| {label} | {r['procs']} | {r['threads_mode']} | {r['policy']} | {what} | | | | | | | | |")
            continue
        ld = r["load_during"]
        lines.append(
            f"| {label} | {r['procs']} | {r['threads_per_proc']} ({r['threads_mode']}) | {r['policy']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_mean']:,.0f} | {r['tokens_per_s_best']:,.0f} | "
            f"{r['loss_step1']:.4f} | "
            f"{r['loss_last']:.4f} | {r['eval_loss']:.4f} | {r['cpu_s']:.0f} | "
            f"{ld['mean']:.2f} ({ld['min']:.2f}-{ld['max']:.2f}) | {r['wall_s']:.0f} |")

    def find(system, procs, threads, policy):
        return next((r for r in runs if (r["system"], r["procs"], r["threads_mode"], r["policy"])
                     == (system, procs, threads, policy)), None)

    lines += ["", "Ratios (same run):", "",
              "| processes | threads | precision | phalanx / PyTorch tokens/s (median step) | same (best step) | "
              "held-out loss phalanx - PyTorch |", "|---|---|---|---|---|---|"]
    cells = sorted({(r["procs"], r["threads_mode"], r["policy"]) for r in runs})
    for procs, threads, policy in cells:
        p, q = find("phalanx", procs, threads, policy), find("torch", procs, threads, policy)
        if p and q:
            lines.append(f"| {procs} | {threads} | {policy} | {p['tokens_per_s'] / q['tokens_per_s']:.2f}x | "
                         f"{p['tokens_per_s_best'] / q['tokens_per_s_best']:.2f}x | "
                         f"{p['eval_loss'] - q['eval_loss']:+.4f} |")
    scaling = ["", "| system | precision | 2 processes / 1 process tokens/s (match) | same (split) | "
               "bfloat16 / float32 tokens/s (1 process) | same (2 processes, match) |", "|---|---|---|---|---|---|"]
    for system in ("phalanx", "torch") if find_any(runs, "match") else ():
        for policy in POLICIES:
            one = find(system, 1, "match", policy)
            cols = []
            for threads in ("match", "split"):
                two = find(system, 2, threads, policy)
                cols.append(f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one and two else "-")
            bf = []
            for procs in (1, 2):
                f32, b16 = find(system, procs, "match", "float32"), find(system, procs, "match", "mixed_bfloat16")
                bf.append(f"{b16['tokens_per_s'] / f32['tokens_per_s']:.2f}x" if f32 and b16 else "-")
            if policy == "mixed_bfloat16":
                bf = ["", ""]
            scaling.append(f"| {system} | {policy} | {cols[0]} | {cols[1]} | {bf[0]} | {bf[1]} |")
    if len(scaling) > 3:
        lines += scaling
    lines += [
        "",
        "Notes:",
        "",
        "- 2 processes on 2 cores: data parallelism cannot speed anything up here; the 2-process rows measure "
        "what the all-reduce and the second process cost on the same cores (ratio near 1.0x is the ideal).",
        "- Both systems start from the same float32 weights and read the same batches, so the step-1 losses must "
        "agree (to bfloat16 rounding in mixed precision); later losses drift apart by rounding only.",
        "- Precision differs in kind: phalanx's `mixed_bfloat16` keeps the residual stream, LayerNorm outputs and "
        "attention probabilities in bfloat16 (LayerNorm statistics, softmax and the loss in float32); torch "
        "autocast runs matmuls/linear/SDPA in bfloat16 and leaves the residual stream and LayerNorm in float32.",
        "- CPU s: user + system seconds of all of a run's processes, start-up included; wall s also includes "
        "start-up (imports, data, tracing; phalanx's end-of-run checkpoint). PyTorch's OpenMP threads spin while "
        "they wait at barriers, so on a loaded machine with more threads than free cores its step times spread "
        "widely (compare the median- and mean-based tokens/s).",
        "- PyTorch runs eagerly (no `torch.compile`) with fused SDPA attention; its AdamW is the default "
        "(for-loop on CPU). phalanx runs its trainer with `train.log_every=1` (a loss read-back every step, "
        "as PyTorch's `loss.item()`); the timed step includes the input fetch on both sides.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.torch_worker:
        return torch_worker_main(args.torch_worker)
    if args.export:
        return export_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
