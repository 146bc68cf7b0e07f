"""Multi-host start-up: find this process's place in the job and join the others.

:func:`initialize` (called first thing by ``python -m jaxllm.train``) reads the
launcher's environment, restricts the GPUs this process sees when several
processes share a node, and calls :func:`jax.distributed.initialize` with
timeouts, so that a lost process makes the others fail within a bounded time
instead of hanging in a collective.  With no launcher in sight it does nothing
and the run is single-process.

Where the numbers come from (the first match wins; explicit ``JAXLLM_*``
variables override any detected value):

* explicit: ``JAXLLM_PROCESS_ID`` / ``JAXLLM_NUM_PROCESSES``, ``JAXLLM_COORDINATOR_ADDRESS``;
* ompi: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE``;
* pals (Polaris' ``mpiexec``): ``PALS_RANKID``, ``PALS_LOCAL_RANKID``, ``PALS_LOCAL_SIZE``; the
  world size from ``PMI_SIZE``, else local size x nodes of ``PBS_NODEFILE``;
* pmi (MPICH, Intel MPI): ``PMI_RANK`` / ``PMI_SIZE``, ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS``
  (or ``PMI_LOCAL_RANK`` / ``PMI_LOCAL_SIZE``);
* slurm (``srun``): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, tasks on this node from ``SLURM_STEP_TASKS_PER_NODE``.

The node list: ``PBS_NODEFILE``, else ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``
(expanded by ``scontrol show hostnames``, or by :func:`expand_nodelist`).

MPI ranks win over Slurm's because ``mpirun``/``mpiexec`` under Slurm start their
per-node daemons with ``srun``, whose SLURM_PROCID is then the node, not the rank.
The coordinator (process 0's service) is ``first host of the node list:PORT``,
``PORT`` from ``JAXLLM_COORDINATOR_PORT`` (default 12355); MPI without a node
list needs ``JAXLLM_COORDINATOR_ADDRESS``.

Other knobs: ``JAXLLM_INIT_TIMEOUT`` (s to wait for all processes to join,
default 300), ``JAXLLM_HEARTBEAT_TIMEOUT`` (s after which a silent process is
declared dead and the job aborts, default 20), ``JAXLLM_SHUTDOWN_TIMEOUT`` (s the
finished processes wait for the others at exit, default 120).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from jaxllm.errors import ConfigError

DEFAULT_PORT = 12355
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


class LaunchError(ConfigError):
    """A launch environment that cannot work: names the variable, its value and the fix.

    A :class:`~jaxllm.config.ConfigError`, so the CLI prints it as one line and exits 2."""

    def __init__(self, key: str, value, fix: str):
        super().__init__(key, value, fix)
        self.args = (f"launch environment error: {key}={value!r}: {fix}",)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits in a multi-process job.

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: processes in the job.
      process_id: this process, ``0 .. num_processes - 1``.
      local_rank: this process among those on its node (None: unknown).
      local_size: processes on this node (None: unknown).
      local_device_ids: the node's accelerator ids this process should use: ``(local_rank,)``
        with several processes per node, None (all of the node's) with one.
      source: how it was detected: ``slurm``, ``pals``, ``ompi``, ``pmi`` or ``explicit``
        (``+explicit`` when a JAXLLM_* variable overrode part of it).
      nodes: the job's hosts, in order (empty when unknown).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_rank: int | None = None
    local_size: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "explicit"
    nodes: tuple[str, ...] = ()


# ---------------------------------------------------------------- node lists

def _split_top(text: str) -> list[str]:
    """Splits at commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail, out = name[:m.start()], name[m.end():], []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot parse the node list range {item!r} in {name!r}")
        width = len(lo)  # Slurm keeps the zero padding of the lower bound
        for n in range(int(lo), int(hi or lo) + 1):
            out += [f"{head}{n:0{width}d}{rest}" for rest in _expand_one(tail)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names, e.g. ``nid[001-002,007],login1`` ->
    ``["nid001", "nid002", "nid007", "login1"]`` (several bracket groups per name work too).

    Raises:
      ValueError: a range that is not numeric.
    """
    return [host for part in _split_top(nodelist) for host in _expand_one(part)]


def slurm_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` when available (it knows every Slurm syntax), else
    :func:`expand_nodelist`."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(nodelist)


def _nodefile_hosts(path: str) -> list[str]:
    """Unique hosts of a PBS node file (one line per slot), in order."""
    try:
        with open(path) as f:
            return list(dict.fromkeys(line.strip() for line in f if line.strip()))
    except OSError as e:
        raise LaunchError("PBS_NODEFILE", path, f"cannot read it ({e.strerror})") from None


def _task_counts(spec: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` syntax: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(spec)
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


# ---------------------------------------------------------------- detection

def _int(environ: Mapping[str, str], key: str, *, minimum: int = 0) -> int | None:
    value = environ.get(key)
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        raise LaunchError(key, value, "must be an integer") from None
    if n < minimum:
        raise LaunchError(key, value, f"must be >= {minimum}")
    return n


def _nodes(environ: Mapping[str, str], scontrol: bool) -> tuple[tuple[str, ...], str]:
    """The job's hosts and where they came from (PBS node file, then Slurm's step/job list)."""
    if environ.get("PBS_NODEFILE"):
        return tuple(_nodefile_hosts(environ["PBS_NODEFILE"])), "PBS_NODEFILE"
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(key):
            try:
                hosts = slurm_hostnames(environ[key]) if scontrol else expand_nodelist(environ[key])
            except ValueError as e:
                raise LaunchError(key, environ[key], f"cannot expand the node list: {e}") from None
            return tuple(hosts), key
    return (), ""


def _ranks(environ: Mapping[str, str], nodes: tuple[str, ...]):
    """``(source, process_id, num_processes, local_rank, local_size)`` from the first launcher
    whose rank variable is set, or None."""
    if "OMPI_COMM_WORLD_RANK" in environ:
        return ("ompi", _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE", minimum=1),
                _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1))
    if "PALS_RANKID" in environ:
        local_size = _int(environ, "PALS_LOCAL_SIZE", minimum=1) or _int(environ, "PMI_LOCAL_SIZE", minimum=1)
        size = _int(environ, "PMI_SIZE", minimum=1) or _int(environ, "PALS_SIZE", minimum=1)
        if size is None and local_size and nodes:
            size = local_size * len(nodes)  # PALS has no world-size variable of its own
        return "pals", _int(environ, "PALS_RANKID"), size, _int(environ, "PALS_LOCAL_RANKID"), local_size
    if "PMI_RANK" in environ:
        local_rank = _int(environ, "MPI_LOCALRANKID")
        local_rank = _int(environ, "PMI_LOCAL_RANK") if local_rank is None else local_rank
        local_size = _int(environ, "MPI_LOCALNRANKS", minimum=1) or _int(environ, "PMI_LOCAL_SIZE", minimum=1)
        return "pmi", _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE", minimum=1), local_rank, local_size
    if "SLURM_PROCID" in environ:
        size = _int(environ, "SLURM_STEP_NUM_TASKS", minimum=1) or _int(environ, "SLURM_NTASKS", minimum=1)
        local_size = None
        spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        node = _int(environ, "SLURM_NODEID")
        if spec:
            try:
                counts = _task_counts(spec)
            except ValueError:
                raise LaunchError("SLURM_STEP_TASKS_PER_NODE", spec, "expected Slurm's N(xM),... syntax") from None
            local_size = counts[node] if node is not None and node < len(counts) else None
        if local_size is None and size and nodes and size % len(nodes) == 0:
            local_size = size // len(nodes)
        return "slurm", _int(environ, "SLURM_PROCID"), size, _int(environ, "SLURM_LOCALID"), local_size
    return None


def detect(environ: Mapping[str, str], *, scontrol: bool = True) -> Topology | None:
    """This process's :class:`Topology` from a launcher's environment; None when single-process
    (no launcher variables at all).

    Args:
      environ: the environment (``os.environ``).
      scontrol: expand Slurm node lists with ``scontrol show hostnames`` when it is installed.
    Raises:
      LaunchError: inconsistent or incomplete variables (names the variable and the fix).
    """
    explicit_n = _int(environ, "JAXLLM_NUM_PROCESSES", minimum=1)
    explicit_id = _int(environ, "JAXLLM_PROCESS_ID")
    explicit_addr = environ.get("JAXLLM_COORDINATOR_ADDRESS") or None
    if (explicit_n is None) != (explicit_id is None):
        have, missing = (("JAXLLM_NUM_PROCESSES", "JAXLLM_PROCESS_ID") if explicit_id is None
                         else ("JAXLLM_PROCESS_ID", "JAXLLM_NUM_PROCESSES"))
        raise LaunchError(have, environ[have], f"set {missing} too (or neither, to detect both from the launcher)")
    port = _int(environ, "JAXLLM_COORDINATOR_PORT", minimum=1)
    port = DEFAULT_PORT if port is None else port

    nodes, nodes_from = _nodes(environ, scontrol)
    found = _ranks(environ, nodes)
    if found is None and explicit_n is None:
        if explicit_addr:
            raise LaunchError("JAXLLM_COORDINATOR_ADDRESS", explicit_addr,
                              "no launcher (Slurm, PALS, Open MPI, PMI) detected: also set JAXLLM_NUM_PROCESSES "
                              "and JAXLLM_PROCESS_ID")
        return None
    source, pid, n, local_rank, local_size = found or ("explicit", None, None, None, None)
    rank_var, size_var = {"ompi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), "pals": ("PALS_RANKID", "PMI_SIZE"),
                          "pmi": ("PMI_RANK", "PMI_SIZE"), "slurm": ("SLURM_PROCID", "SLURM_NTASKS")
                          }.get(source, ("JAXLLM_PROCESS_ID", "JAXLLM_NUM_PROCESSES"))
    if explicit_n is not None:
        source = "explicit" if found is None else source + "+explicit"
        n, pid = explicit_n, explicit_id
    if n is None:
        fix = ("set PMI_SIZE, or PALS_LOCAL_SIZE with PBS_NODEFILE" if source.startswith("pals")
               else "launch with the scheduler's launcher, or set JAXLLM_NUM_PROCESSES and JAXLLM_PROCESS_ID")
        raise LaunchError(size_var, None, f"the number of processes is unknown: {fix}")
    if pid is None or not 0 <= pid < n:
        raise LaunchError("JAXLLM_PROCESS_ID" if explicit_n is not None else rank_var, pid,
                          f"the process id must be in 0..{n - 1} (there are {n} processes)")

    if explicit_addr:
        source += "+explicit" if "explicit" not in source else ""
        address = explicit_addr if re.search(r":\d+$", explicit_addr) else f"{explicit_addr}:{port}"
    elif nodes:
        address = f"{nodes[0]}:{port}"
    else:
        raise LaunchError("JAXLLM_COORDINATOR_ADDRESS", None,
                          f"{source} gives ranks but no node list (no PBS_NODEFILE or SLURM_*NODELIST): set it to "
                          "process 0's host[:port], reachable from every node")
    if local_rank is not None and local_size is not None and not 0 <= local_rank < local_size:
        local_rank = local_size = None  # inconsistent launcher variables: do not restrict devices on them
    devices = (local_rank,) if local_rank is not None and (local_size or 1) > 1 else None
    return Topology(address, n, pid, local_rank, local_size, devices, source, nodes)


# ---------------------------------------------------------------- devices

def gpu_vendor(environ: Mapping[str, str]) -> str | None:
    """``"cuda"``, ``"rocm"`` or None (CPU), from ``JAX_PLATFORMS`` or the device files present."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if "rocm" in platforms:
        return "rocm"
    if "cuda" in platforms or "gpu" in platforms:
        return "rocm" if os.path.exists("/dev/kfd") else "cuda"
    if platforms:  # e.g. "cpu"
        return None
    if os.path.exists("/dev/kfd"):
        return "rocm"
    if os.path.exists("/dev/nvidiactl"):
        return "cuda"
    return None


def device_env(topology: Topology, environ: Mapping[str, str], vendor: str | None) -> dict[str, str]:
    """Environment variables that give this process only its own GPU(s) (empty when nothing to do).

    Nothing when the launcher already set a visibility variable (e.g. Frontier's
    ``srun --gpus-per-task=1 --gpu-bind=closest`` sets ROCR_VISIBLE_DEVICES), with one process
    per node, or on CPU.  One variable only: on ROCm, HIP honours CUDA_VISIBLE_DEVICES and
    HIP_VISIBLE_DEVICES *after* ROCR_VISIBLE_DEVICES, so setting two would filter twice.
    """
    if topology.local_device_ids is None or vendor is None or any(environ.get(v) for v in VISIBLE_DEVICE_VARS):
        return {}
    var = "ROCR_VISIBLE_DEVICES" if vendor == "rocm" else "CUDA_VISIBLE_DEVICES"
    return {var: ",".join(map(str, topology.local_device_ids))}


def jax_local_device_ids(topology: Topology, environ: Mapping[str, str]) -> list[int] | None:
    """``local_device_ids`` for :func:`jax.distributed.initialize`: ``[local_rank]`` only when the
    launcher made all of the node's GPUs visible to every process (as many as processes per
    node); otherwise None (our own or the launcher's per-process visibility already applies)."""
    if topology.local_device_ids is None:
        return None
    for var in VISIBLE_DEVICE_VARS:
        visible = [v for v in environ.get(var, "").split(",") if v.strip()]
        if len(visible) > 1 and len(visible) == topology.local_size:
            return list(topology.local_device_ids)
    return None


# ---------------------------------------------------------------- start-up

def _timeout(environ, key: str, default: int) -> int:
    value = _int(environ, key, minimum=1)
    return default if value is None else value


def initialize(environ: Mapping[str, str] | None = None) -> Topology | None:
    """Joins the multi-process job this process was launched in; a no-op when single-process.

    Must run before anything touches a JAX backend.  Restricts visible GPUs (see
    :func:`device_env`), selects gloo for CPU collectives, calls
    :func:`jax.distributed.initialize` with the JAXLLM_*_TIMEOUT timeouts, and prints the
    topology once (process 0).

    Args:
      environ: the environment to read and (for device visibility) update; default ``os.environ``.
    Returns:
      the detected :class:`Topology`, or None when single-process.
    Raises:
      LaunchError: a bad environment (the CLI prints it as one line and exits 2).
    """
    import jax  # noqa: PLC0415  (importing jax does not start a backend; keeps detect() jax-free)

    environ = os.environ if environ is None else environ
    topology = detect(environ)
    if topology is None or topology.num_processes == 1:
        return topology
    init_timeout = _timeout(environ, "JAXLLM_INIT_TIMEOUT", 300)
    heartbeat = _timeout(environ, "JAXLLM_HEARTBEAT_TIMEOUT", 20)
    shutdown = _timeout(environ, "JAXLLM_SHUTDOWN_TIMEOUT", 120)
    updates = device_env(topology, environ, gpu_vendor(environ))
    environ.update(updates)  # before the backends start: they read it once
    # CPU collectives across processes need gloo (the default has none); harmless on GPUs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        topology.coordinator_address, topology.num_processes, topology.process_id,
        local_device_ids=jax_local_device_ids(topology, environ),
        cluster_detection_method="deactivate",  # we detected everything; jax's own guess must not override it
        initialization_timeout=init_timeout, heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=shutdown)
    if jax.process_index() == 0:
        local, devices = jax.local_devices(), jax.devices()
        per_node = f", {topology.local_size} per node" if topology.local_size else ""
        visible = f", set {' '.join(f'{k}={v}' for k, v in updates.items())}" if updates else ""
        nodes = f"{len(topology.nodes)} node(s), " if topology.nodes else ""  # unknown (an explicit launch): not said
        print(f"jaxllm.platform.distributed: {topology.num_processes} processes{per_node} "
              f"(detected: {topology.source}), {nodes}coordinator {topology.coordinator_address}; "
              f"{len(local)} local of {len(devices)} global {devices[0].platform} device(s) on process 0{visible}; "
              f"heartbeat timeout {heartbeat} s", flush=True)
    return topology
