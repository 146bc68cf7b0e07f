"""Optimizers and learning-rate schedules (jaxllm.runtime.optim): each optimizer trains a tiny GPT; the
schedules equal megatron-core's OptimizerParamScheduler step for step; every optimizer's state is
ZeRO-sharded on 4 fake devices as the rules table says and updates as on one; resuming a checkpoint with
another optimizer is one line and exit status 2 (the real CLI)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxllm import config
from jaxllm.model import gpt
from jaxllm.resolve import resolve
from jaxllm.runtime import optim

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = config.OPTIMIZERS


def tiny(optimizer="adamw", **train):
    c = config.get_config()
    c.model.update(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, dtype="float32")
    c.train.update(seq_length=16, micro_batch_size=4, global_batch_size=4, warmup_iters=2, lr=1e-2, min_lr=1e-3,
                   train_iters=20, optimizer=optimizer)
    c.train.update(**train)
    return resolve(c, num_devices=1)


def test_an_alias_is_its_optimizer():
    assert tiny("ipex.lamb").train.optimizer == "lamb" and tiny("apex.adam").train.optimizer == "adamw"


def test_lamb_and_adafactor_update_each_layer_as_its_own_matrix():
    """On parameters stacked [layers, ...], lamb's trust ratio and adafactor's statistics are those of
    each layer's matrix: the update equals optax's on the layers one by one."""
    rng = np.random.default_rng(0)
    params = {"layers": {"w": rng.normal(size=(3, 128, 256)).astype(np.float32) * [[[1.0]], [[5.0]], [[0.2]]]},
              "wte": rng.normal(size=(64, 128)).astype(np.float32)}
    axes = {"layers": {"w": ("layers", "embed", "mlp")}, "wte": ("vocab", "embed")}
    grads = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), params)
    unstacked = lambda t: {"wte": t["wte"], **{f"w{i}": t["layers"]["w"][i] for i in range(3)}}  # noqa: E731
    for name in ("lamb", "adafactor"):
        t = tiny(name, grad_clip=0.0, warmup_iters=0).train  # lr > 0 at the first step
        ours = optim.make_optimizer(t, jax.tree.map(lambda _: True, params), axes)
        theirs = optim.make_optimizer(t, jax.tree.map(lambda _: True, unstacked(params)),
                                      {"wte": ("vocab", "embed"), **{f"w{i}": ("embed", "mlp") for i in range(3)}})
        got = jax.jit(ours.update)(grads, ours.init(params), params)[0]
        want = jax.jit(theirs.update)(unstacked(grads), theirs.init(unstacked(params)), unstacked(params))[0]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), unstacked(got), want)


def test_muon_takes_the_layers_matrices_and_adamw_the_rest():
    cfg = tiny("muon")
    spec = gpt.describe(cfg.model)
    dims = optim.muon_dimensions(spec.axes)
    flat = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(
        dims, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))[0]}
    muon = {k: (tuple(d.reduction_axis), tuple(d.output_axis)) for k, d in flat.items() if d is not None}
    assert muon == {"['layers']['attn']['wq']": ((1,), (2, 3)), "['layers']['attn']['wk']": ((1,), (2, 3)),
                    "['layers']['attn']['wv']": ((1,), (2, 3)), "['layers']['attn']['wo']": ((1, 2), (3,)),
                    "['layers']['mlp']['w1']": ((1,), (2,)), "['layers']['mlp']['w2']": ((1,), (2,))}
    assert flat["['wte']"] is None and flat["['wpe']"] is None  # tables: AdamW


# ----- learning-rate schedules against megatron-core ------------------------------------------------

# (train keys, steps to compare): every style, warmup by iterations and by fraction (a fraction of a
# step), min_lr 0 and not, a run longer than the decay, each WSD anneal, and an anneal that overlaps the warmup
SCHEDULES = [
    ({"lr_decay_style": "cosine"}, 120),
    ({"lr_decay_style": "cosine", "warmup_iters": 0, "min_lr": 0.0}, 100),
    ({"lr_decay_style": "linear", "lr_decay_iters": 80}, 120),
    ({"lr_decay_style": "constant", "lr_decay_iters": 80}, 120),
    ({"lr_decay_style": "inverse-square-root", "lr_decay_iters": 90}, 120),
    ({"lr_decay_style": "inverse-square-root", "warmup_iters": 0}, 100),
    ({"lr_decay_style": "cosine", "warmup_iters": 0, "lr_warmup_fraction": 0.05, "lr_decay_iters": 70}, 100),
    ({"lr_decay_style": "linear", "warmup_iters": 0, "lr_warmup_fraction": 0.1, "lr_decay_iters": 95}, 100),
    *[({"lr_decay_style": "WSD", "lr_wsd_decay_style": s, "lr_wsd_decay_iters": 30, "lr_decay_iters": 90}, 120)
      for s in config.LR_WSD_DECAY_STYLES],
    ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "minus_sqrt", "lr_wsd_decay_iters": 95, "min_lr": 0.0}, 100),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "cosine", "warmup_iters": 0, "lr_warmup_fraction": 0.05,
      "lr_wsd_decay_iters": 20, "lr_decay_iters": 100}, 100),
]
GLOBAL_BATCH = 4  # Megatron counts samples: its scheduler advances by the global batch per iteration


@pytest.fixture(scope="module")
def megatron_lrs():
    """``train section -> [lr of iterations 0, 1, ...]`` as megatron-core's OptimizerParamScheduler
    gives them, driven as Megatron-LM's training loop drives it (sample counts; step(global batch)
    after each iteration; the warmup fraction times the decay samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Optimizer:  # what the scheduler reads and writes of an optimizer
        param_groups = [{"params": []}]

    def lrs(t, steps):
        decay = t.lr_decay_iters * GLOBAL_BATCH
        warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction else t.warmup_iters * GLOBAL_BATCH
        opt = Optimizer()
        opt.param_groups = [{"params": []}]
        sched = OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
            lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=t.train_iters * GLOBAL_BATCH, wd_incr_style="constant",
            wsd_decay_steps=t.lr_wsd_decay_iters * GLOBAL_BATCH if t.lr_decay_style == "WSD" else None,
            lr_wsd_decay_style=t.lr_wsd_decay_style)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            sched.step(increment=GLOBAL_BATCH)
        return np.array(out)

    return lrs


@pytest.mark.parametrize("keys,steps", SCHEDULES,
                         ids=[",".join(f"{k}={v}" for k, v in s[0].items()) for s in SCHEDULES])
def test_schedule_equals_megatron_step_for_step(keys, steps, megatron_lrs):
    t = tiny(**{"lr": 3e-3, "min_lr": 3e-4, "train_iters": 100, "warmup_iters": 10, **keys}).train
    ours = np.asarray(jax.jit(jax.vmap(optim.lr_schedule(t)))(jnp.arange(steps, dtype=jnp.int32)))
    np.testing.assert_allclose(ours, megatron_lrs(t, steps), rtol=2e-6, atol=1e-6 * t.lr)


def test_the_optimizer_applies_the_schedule_at_each_step(megatron_lrs):
    """Plain SGD on gradient 1: the update of jaxllm step i (0-based) is minus Megatron's lr of iteration i."""
    t = tiny("sgd", sgd_momentum=0.0, weight_decay=0.0, grad_clip=0.0, lr=3e-3, min_lr=3e-4, train_iters=50,
             warmup_iters=0, lr_warmup_fraction=0.1, lr_decay_style="WSD", lr_wsd_decay_iters=20).train
    opt = optim.make_optimizer(t, {"w": False})

    def step(state, _):
        updates, state = opt.update({"w": jnp.ones(())}, state, {"w": jnp.zeros(())})
        return state, -updates["w"]

    applied = jax.lax.scan(step, opt.init({"w": jnp.zeros(())}), length=60)[1]
    np.testing.assert_allclose(applied, megatron_lrs(t, 60), rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("keys,key", [
    ({"lr_warmup_fraction": 0.05}, "train.lr_warmup_fraction"),  # and warmup_iters=2: one or the other
    ({"lr_warmup_fraction": 1.0, "warmup_iters": 0}, "train.lr_warmup_fraction"),
    ({"warmup_iters": 20}, "train.warmup_iters"),  # = lr_decay_iters: no decay left
    ({"lr_decay_style": "WSD"}, "train.lr_wsd_decay_iters"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 21}, "train.lr_wsd_decay_iters"),
    ({"lr_decay_style": "wsd"}, "train.lr_decay_style"),
    ({"optimizer": "sophiag"}, "train.optimizer"),
    ({"sgd_momentum": 1.0}, "train.sgd_momentum"),
])
def test_schedule_and_optimizer_config_errors(keys, key):
    with pytest.raises(config.ConfigError) as e:
        tiny(**keys)
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)


def test_megatron_names_point_to_the_keys():
    for name in ("optimizer", "lr_decay_style", "lr_warmup_fraction", "lr_wsd_decay_style", "lr_wsd_decay_iters",
                 "sgd_momentum"):
        with pytest.raises(config.ConfigError, match=f"Megatron-DeepSpeed's {name} is train.{name} in jaxllm"):
            setattr(config.get_config().model, name, 1)


# ----- ZeRO: every optimizer's state on 4 devices ----------------------------------------------------

ZERO_SCRIPT = textwrap.dedent('''
    import json, os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np, optax
    from jaxllm import config
    from jaxllm.model import gpt
    from jaxllm.parallel import sharding
    from jaxllm.resolve import resolve
    from jaxllm.runtime import optim

    def cfg(name, devices):
        c = config.get_config()
        # hidden 128 and MLP 512: Adafactor factors the matrices (two dimensions >= 128)
        c.model.update(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=128, dtype="float32")
        c.train.update(seq_length=16, micro_batch_size=2, global_batch_size=4, warmup_iters=0, lr=1e-2,
                       min_lr=1e-3, train_iters=10, optimizer=name)
        if name == "lion":  # its update is a moment's sign: the global norm's last bit, which a sharded sum rounds
            c.train.grad_clip = 0.0  # otherwise, flips an element near 0 (0.011 = lr apart on XLA 0.12)
        if devices == 4:
            c.mesh.update(data=2, tensor=2)
            c.parallel.zero_stage = 1
        return resolve(c, num_devices=devices)

    spec = gpt.describe(cfg("adamw", 1).model)
    tokens = np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32)
    loss = lambda p: gpt.loss(spec.graphdef, p, tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].size
    value_and_grad = jax.jit(jax.value_and_grad(loss))  # the model on device 0, compiled once
    params0 = gpt.init(cfg("adamw", 1).model, 0)
    mesh = sharding.make_mesh(cfg("adamw", 4))

    def apply(opt):
        def step(g, s, p):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        return step

    out = {}
    for name in config.OPTIMIZERS:
        c4 = cfg(name, 4)
        opt = optim.make_optimizer(c4.train, spec.decay, spec.axes)
        abstract = {"params": spec.params, "opt_state": jax.eval_shape(opt.init, spec.params)}
        sh = sharding.state_shardings(c4, abstract, spec.axes, mesh)
        grad_sh = sharding.grad_shardings(c4, spec.axes, mesh)
        p1, s1, losses = params0, opt.init(params0), []
        p4, s4 = jax.device_put((params0, s1), (sh["params"], sh["opt_state"]))
        sharded = jax.jit(apply(opt), in_shardings=(grad_sh, sh["opt_state"], sh["params"]),
                          out_shardings=(sh["params"], sh["opt_state"]))
        single = jax.jit(apply(opt))  # device 0
        for _ in range(8):  # one device trains; the 4 devices apply the same gradients
            value, grads = value_and_grad(p1)
            losses.append(float(value))
            p1, s1 = single(grads, s1, p1)
            p4, s4 = sharded(jax.device_put(grads, grad_sh), s4, p4)
        leaves = jax.tree_util.tree_flatten_with_path(s4)[0]
        out[name] = {
            "losses": losses,
            "max_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                            for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1))),
            "opt_fraction": sharding.per_device_bytes(s4) / sum(leaf.nbytes for _, leaf in leaves),
            # the state's arrays that belong to w1 [layers, embed, mlp] (moments; Adafactor's row/column statistics)
            "w1": sorted({(tuple(leaf.shape), str(tuple(leaf.sharding.spec))) for path, leaf in leaves
                          if jax.tree_util.keystr(path).endswith("['mlp']['w1']") and leaf.size > 2}),
        }
    sys.stdout.write(json.dumps(out))
''')


@pytest.fixture(scope="module")
def four_devices():
    """Every optimizer: 8 steps of a tiny GPT on one device, and the same gradients applied to its
    ZeRO-1 state on data 2 x tensor 2 (4 fake CPU devices, one subprocess)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", ZERO_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_trains(name, four_devices):
    losses = four_devices[name]["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero_shards_each_optimizers_state_on_4_devices(name, four_devices):
    """Each optimizer's state is split as the rules table says (its moments as the parameters, plus `data`
    on `embed`; Adafactor's factored statistics as the parameter without the factored-out dimension),
    holds about a quarter of the state per device, and updates as on one device."""
    res = four_devices[name]
    assert res["max_diff"] < 1e-5 and res["opt_fraction"] < 0.3, res
    moment = [[2, 128, 512], "('pipeline', ('fsdp', 'data', 'expert', 'sequence'), 'tensor')"]
    if name == "adafactor":  # momentum (beta1) as the parameter; row and column statistics without mlp / embed
        assert res["w1"] == [[[2, 128], "('pipeline', ('fsdp', 'data', 'expert', 'sequence'))"], moment,
                             [[2, 512], "('pipeline', 'tensor')"]], res["w1"]
    else:
        assert res["w1"] == [moment], res["w1"]


# ----- checkpoints record their optimizer -------------------------------------------------------------

def run_cli(workdir, text_file, **keys):
    flags = {"model.num_layers": 1, "model.hidden_size": 32, "model.num_attention_heads": 2,
             "model.dtype": "float32", "train.seq_length": 16, "train.micro_batch_size": 4,
             "train.global_batch_size": 4, "train.train_iters": 3, "train.warmup_iters": 0,
             "train.lr_decay_style": "linear", "train.lr": 1e-2, "train.min_lr": 1e-3, "train.eval_interval": 0,
             "train.log_interval": 1, "data.input": str(text_file), "data.tokenizer": "byte",
             "data.sampling": "uniform", "data.split": "9,1", "checkpoint.interval": 0, "log.samples": 0,
             "log.tensorboard": False, "log.progress_bar": False, **keys}
    cmd = [sys.executable, "-m", "jaxllm.train", f"--workdir={workdir}",
           *(f"--config.{k}={v}" for k, v in flags.items())]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_resuming_with_another_optimizer_is_one_line_and_exit_2(tmp_path):
    text = tmp_path / "text.txt"
    rng = np.random.default_rng(0)
    words = ["optimizer", "schedule", "warmup", "decay", "moment", "layer", "step", "state"]
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    workdir = tmp_path / "run"
    r = run_cli(workdir, text, **{"train.optimizer": "lion"})
    assert r.returncode == 0, r.stderr[-3000:]
    # the logged learning rate is the one each step applied: linear from lr at step 0 to min_lr at 3
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([m["lr"] for m in logged if m["kind"] == "train"], [1e-2, 7e-3, 4e-3], rtol=1e-6)

    r = run_cli(workdir, text, **{"train.optimizer": "adamw", "train.train_iters": 6})
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("config error: train.optimizer='adamw': the checkpoint at step 3 in "), errors
    assert "holds the state of train.optimizer=lion; resume with --config.train.optimizer=lion" in errors[0]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3"]  # not taken for damaged


def test_the_optimizer_check_of_a_checkpoint(tmp_path):
    """What decides whether an optimizer state fits, without writing one: the optimizer's name (a checkpoint
    from before train.optimizer holds AdamW's), and for sgd and adafactor whether momentum is on."""
    from jaxllm.runtime.checkpoint import Checkpointer

    def check(saved_train, **ours):
        ckpt = Checkpointer(str(tmp_path), tiny(**ours))
        try:
            ckpt._check_optimizer_matches(7, {"train": saved_train})
        finally:
            ckpt.close()

    check({})  # AdamW's
    check({"optimizer": "ipex.lamb"}, optimizer="lamb")
    check({"optimizer": "sgd", "sgd_momentum": 0.5}, optimizer="sgd", sgd_momentum=0.9)
    for saved, ours, key in [({}, {"optimizer": "lion"}, "train.optimizer"),
                             ({"optimizer": "sgd", "sgd_momentum": 0.9}, {"optimizer": "sgd", "sgd_momentum": 0.0},
                              "train.sgd_momentum"),
                             ({"optimizer": "adafactor", "beta1": 0.0}, {"optimizer": "adafactor"}, "train.beta1")]:
        with pytest.raises(config.ConfigError) as e:
            check(saved, **ours)
        assert e.value.key == key and "the checkpoint at step 7" in str(e.value), str(e.value)
