"""A model of a training step's time on a cluster, from a plan: ``jaxllm.plan --cluster=NAME --mfu=M``.

It is a model, not a measurement.  A step is

* compute: the model FLOPs of a step (:func:`jaxllm.runtime.flops.flops_per_step`) at the stated MFU
  of every device's dense peak (:data:`jaxllm.platform.hardware.PEAK_FLOPS`);
* the pipeline bubble: the schedule's idle fraction ``b`` of each stage's loop
  (:func:`jaxllm.parallel.schedules.schedule_bubble`) stretches the compute to ``compute / (1 - b)``;
* communication: for each set of mesh axes, the bytes each device sends in the compiled program's
  collectives (:func:`jaxllm.analysis.collectives.collectives`: ring algorithms, loop trip counts
  included) over the link those axes cross (inside a node, or off it: the devices are numbered node by
  node in the mesh's order, the innermost axes inside a node), plus a latency per ring step;
  Hockney's alpha-beta model (Hockney 1994, "The communication challenge for MPP").

Nothing overlaps: the step is the sum, an upper bound where XLA overlaps collectives with compute (the
data-parallel gradient reduction, ring attention's transfers).  Left out: contention between axes that
share a link, the network's topology beyond node / not node, kernel launch and host time, the
optimizer's memory-bound update.
"""

from __future__ import annotations

import math

import numpy as np

from jaxllm.platform.hardware import Cluster, lookup_peak_flops


def crosses_nodes(axes: tuple[str, ...], mesh_shape: dict, per_node: int) -> bool:
    """Whether a group of devices along ``axes`` (mesh axis names) spans more than one node, the mesh's
    devices being numbered node by node in its flat order."""
    index = tuple(slice(None) if a in axes else 0 for a in mesh_shape)
    members = np.arange(math.prod(mesh_shape.values())).reshape(tuple(mesh_shape.values()))[index]
    return len(set((members.ravel() // per_node).tolist())) > 1


def check_mfu(cluster_name: str, mfu: float | None) -> None:
    """``--cluster``'s ``--mfu``: given (none is assumed) and a fraction in (0, 1].

    Raises:
      ValueError: one line naming the flag and the fix.
    """
    if mfu is None:
        raise ValueError(f"--cluster={cluster_name}: state the MFU the compute runs at, e.g. --mfu=0.4 (no measured "
                         "one is assumed)")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu={mfu}: give the model FLOPs utilization as a fraction in (0, 1], e.g. 0.4")


def estimate(plan: dict, cluster: Cluster, mfu: float) -> dict:
    """The step-time model of a plan (:func:`jaxllm.plan.plan` with ``collectives=True``) on ``cluster``.

    Args:
      plan: its ``model_flops``, ``mesh``, ``compute_dtype``, ``bubble``, ``collectives``, ``seq_tokens``.
      cluster: the machine (:data:`jaxllm.platform.hardware.CLUSTERS`).
      mfu: the model FLOPs utilization assumed for the compute, in (0, 1].
    Returns:
      ``{"compute", "bubble", "step"}`` in seconds, ``"comms"``: ``{axes: (seconds, bytes sent per device,
      crosses nodes)}``, ``"tokens_per_s"``, ``"tflops_per_device"`` (model FLOPs / step time / devices,
      in TFLOP/s) and ``"peak"`` (FLOP/s per device).
    Raises:
      ValueError: ``mfu`` out of range, or the cluster's device has no peak for the compute dtype.
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu}: a fraction in (0, 1]")
    found = lookup_peak_flops(cluster.device, plan["compute_dtype"])
    if found is None:
        raise ValueError(f"no peak FLOP/s for {cluster.device} in {plan['compute_dtype']} (PEAK_FLOPS)")
    peak = found[0]
    devices = math.prod(plan["mesh"].values())
    compute = plan["model_flops"] / (devices * peak * mfu)
    bubble = compute / (1 - plan["bubble"]) - compute
    comms = {}
    for axes, traffic in plan["collectives"].items():
        off = crosses_nodes(axes, plan["mesh"], cluster.per_node)
        bandwidth, latency = (cluster.inter_bw, cluster.inter_latency) if off else (cluster.intra_bw,
                                                                                  cluster.intra_latency)
        comms[axes] = (traffic.wire / bandwidth + traffic.hops * latency, traffic.wire, off)
    step = compute + bubble + sum(t for t, _, _ in comms.values())
    return {"compute": compute, "bubble": bubble, "comms": comms, "step": step, "peak": peak,
            "tokens_per_s": plan["seq_tokens"] / step, "tflops_per_device": plan["model_flops"] / step / devices / 1e12}


def report(est: dict, plan: dict, cluster_name: str, cluster: Cluster, mfu: float) -> str:
    """The model's breakdown as text, saying that it is a model."""
    devices = math.prod(plan["mesh"].values())
    step = est["step"]
    share = lambda t: f"{t:10.3f} s  {t / step:6.1%}"  # noqa: E731
    lines = [f"step-time MODEL on {cluster_name} ({devices} x {cluster.device}, {cluster.per_node} per node; not a "
             "measurement: jaxllm/analysis/step_time.py says what it leaves out, jaxllm/platform/hardware.py "
             "CLUSTERS its sources):",
             f"  compute             {share(est['compute'])}   (model FLOPs at MFU {mfu:.0%} of "
             f"{est['peak'] / 1e12:.1f} TFLOP/s per device)"]
    if est["bubble"]:
        lines.append(f"  pipeline bubble     {share(est['bubble'])}   ({plan['bubble']:.1%} of each stage's loop)")
    for axes, (t, sent, off) in sorted(est["comms"].items(), key=lambda kv: -kv[1][0]):
        link = (f"off the node, {cluster.inter_bw / 1e9:g} GB/s" if off else
                f"inside a node, {cluster.intra_bw / 1e9:g} GB/s")
        lines.append(f"  {' x '.join(axes):<19} {share(t)}   ({sent / 1e9:.2f} GB sent per device, {link})")
    tflops = est["tflops_per_device"]
    lines.append(f"  step                {step:10.3f} s           {est['tokens_per_s']:,.0f} tokens/s, {tflops:.1f} "
                 f"TFLOP/s per device ({tflops * 1e12 / est['peak']:.1%} of peak); no overlap of communication and "
                 "compute assumed")
    return "\n".join(lines)
