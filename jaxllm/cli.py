"""What the command-line tools share: the ``--config`` flag, flag parsing where every mistake is
one line and exit status 2, Megatron-LM's flags taken for the ``--config.*`` keys they mean, and
fake CPU devices for the planning tools.

Imports nothing heavy at module level: :func:`force_host_devices` must run before jax starts.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import functools
import os
import signal
import socket
import sys
import tempfile
import threading

from jaxllm.errors import MEGATRON_NAMES, ConfigError, DataError
from jaxllm.platform import console

console.quiet_absent_gpu_plugin()  # every tool imports this module before JAX starts (see platform/console.py)

EXIT_USAGE = 2  # a bad flag, config, data or launch environment: one line on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): the shell's status, 128 + 2
EXIT_TERMINATED = 143  # SIGTERM (where no save is due): 128 + 15
# XLA:CPU holds at most this many devices in one process: a device's global id is its process index x 2,048
# + its local index (kMaxCpuDevicesPerProcess, xla/pjrt/plugin/xla_cpu/cpu_topology.h).  The planning tools
# compile larger meshes with the other devices on stand-in processes (:func:`stand_in_processes`).
MAX_HOST_DEVICES = 2048
# stand_in_processes' most: each is a client of the job in this process, with a few threads of its own.
MAX_STAND_INS = 1024
_STAND_INS: list = []  # the threads of stand_in_processes, each holding its client in the job until _LEAVE
_LEAVE = threading.Event()
_IN_PROCESS: list[str] = []  # the tools run_tool is running in this process, innermost last


def exit_now(code: int = 0):
    """Exits with ``code`` without Python's teardown (``os._exit``, the output flushed first): a process of
    thousands of fake devices would wait for XLA:CPU to join their threads (a thread each) one by one, and
    one with :func:`stand_in_processes` for them at the ``jax.distributed`` shutdown barrier.  Inside
    :func:`run_tool`'s call of a tool: ``SystemExit(code)``, the caller's process goes on."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _IN_PROCESS:
        raise SystemExit(code)
    os._exit(code)


def fail(message: str, code: int = EXIT_USAGE, *, now: bool = False):
    """Prints ``message`` as one line on stderr and exits with ``code``; ``now``: through :func:`exit_now`."""
    sys.stderr.write(" ".join(str(message).split("\n")) + "\n")  # one write: other processes' lines stay apart
    sys.stderr.flush()
    if now:
        exit_now(code)
    sys.exit(code)


# what each of our errors prints before its message; a tool's own types come on top (usage_errors)
USAGE_ERRORS = {ConfigError: "", DataError: "data error: "}


@contextlib.contextmanager
def usage_errors(more: dict | None = None, *, now: bool = False, report=None):
    """Inside: a :class:`ConfigError` (its message names the key), :class:`DataError` (``"data error: "``
    before it) or an exception of a type in ``more`` (type -> the words before its message) becomes one
    line on stderr and exit status :data:`EXIT_USAGE`, through :func:`fail` (``now``: :func:`exit_now`)
    or ``report(line)`` (which exits).  The most derived of the exception's types that has an entry decides
    (a DataError is a ValueError: ``{ValueError: "error: "}`` leaves it ``"data error: "``)."""
    table = {**USAGE_ERRORS, **(more or {})}
    try:
        yield
    except tuple(table) as e:
        line = next(table[c] for c in type(e).__mro__ if c in table) + str(e)
        if report is not None:
            report(line)
        fail(line, now=now)


class Terminated(BaseException):
    """SIGTERM in a tool (or a phase of one) with nothing to save: raised where Ctrl-C raises KeyboardInterrupt."""


@contextlib.contextmanager
def stoppable(tool: str, kept: str = "nothing written"):
    """Inside (or, as a decorator, in a tool's ``main``): Ctrl-C (SIGINT) and SIGTERM stop the tool at whatever it
    is doing with one line on stderr, ``TOOL: interrupted (Ctrl-C); KEPT`` (exit :data:`EXIT_INTERRUPTED`) or
    ``TOOL: terminated (SIGTERM); KEPT`` (:data:`EXIT_TERMINATED`), never a traceback.  The tools write a file whole
    or not at all, so ``kept`` says what is left.  Code inside that catches KeyboardInterrupt itself says more
    (jaxllm.train saves instead); SIGTERM is taken only where nothing else handles it.

    An interrupt raised inside a library's callback (JAX's garbage-collection callback, a ``__del__``) is printed
    and dropped by Python ("Exception ignored in ...") and the tool would run on to its end: the unraisable hook
    here delivers such an interrupt again, to the main thread's code, as the signal it was.
    """
    hook, term = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    own_term = threading.current_thread() is threading.main_thread() and term is signal.SIG_DFL
    sys.unraisablehook = functools.partial(_redeliver, hook)
    if own_term:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    except KeyboardInterrupt:
        fail(f"{tool}: interrupted (Ctrl-C); {kept}", code=EXIT_INTERRUPTED)
    except Terminated:
        fail(f"{tool}: terminated (SIGTERM); {kept}", code=EXIT_TERMINATED)
    finally:
        sys.unraisablehook = hook
        if own_term:
            signal.signal(signal.SIGTERM, term)


def _terminate(signum, frame):
    raise Terminated


def _redeliver(previous, unraisable) -> None:
    """sys.unraisablehook: an interrupt a callback swallowed is sent again to the main thread, from a timer
    thread a moment later (sent from here, it would be raised in this hook, which Python swallows too)."""
    signum = {KeyboardInterrupt: signal.SIGINT, Terminated: signal.SIGTERM}.get(unraisable.exc_type)
    if signum is None:
        return previous(unraisable)
    threading.Timer(0.02, _thread.interrupt_main, (signum,)).start()


def check_output(flag: str, path: str, *, directory: bool = True) -> None:
    """Before any work: a tool can write ``path`` (``directory``: a folder it fills, created if missing; else a
    file or a prefix of files, created in its folder).  Creates nothing: the nearest folder that exists must be a
    writable directory, a ``directory`` that exists must be one, and a file that exists (appended to) must be a
    writable file.

    Raises:
      ConfigError: naming ``flag``, the path, the cause and the fix.
    """
    path = os.path.abspath(path)
    if directory and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(flag, path, "is a file; give a directory (created if missing)")
    if not directory and os.path.isdir(path):
        raise ConfigError(flag, path, "is a directory; give a file name (in it, or beside it)")
    if not directory and os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(flag, path, "exists and cannot be written (read-only); give another file, or make it "
                          "writable")
    parent = path if directory else os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(flag, path, f"{parent} is a file, not a directory; give a path under a directory")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ConfigError(flag, path, f"cannot be written ({e.strerror}: {parent}); give a place you can "
                          "write") from None


def run_tool(main, define_flags, argv: list[str] | None = None) -> int:
    """A tool built on absl (``jaxllm.train``, ``plan``, ``bench``, ``tune``, ``generate``, ``inspect_data``),
    ``main`` its absl main and ``define_flags(flag_values, argv)`` its flags.

    ``argv`` None: the tool is this process (``python -m jaxllm.TOOL``): absl's ``app.run`` with the flags defined
    in absl's global ``FLAGS`` (its ``--help``, its logging); exits.  A list (the arguments after
    ``python -m jaxllm.TOOL``): the tool runs in this process, as that command would, and returns its exit status.
    Its flags are parsed into a ``FlagValues`` of this call, which the tool sees as ``absl.flags.FLAGS`` (and
    ``sys.argv`` as the command's) while it runs; both, and ``os.environ`` (the XLA and GPU settings a tool makes
    before a backend starts), are as they were when it returns, so calls leave nothing to the next.  It prints what
    the process would (one line on stderr for a bad flag, config or data).  What a process fixes once stays this
    process's: its JAX backend and device count (a tool asking for more devices than this process has is refused
    as on such a machine), and the console of a training run that started (``platform/console.py``).
    """
    from absl import app, flags  # noqa: PLC0415

    if argv is None:
        define_flags(flags.FLAGS, sys.argv)
        app.run(main, flags_parser=parse_flags)
    command = [sys.modules[main.__module__].__file__, *map(str, argv)]
    saved = flags.FLAGS, sys.argv, dict(os.environ)
    flags.FLAGS, sys.argv = flags.FlagValues(), command
    _IN_PROCESS.append(main.__module__)
    try:
        define_flags(flags.FLAGS, command)
        main(parse_flags(command))
        return 0
    except SystemExit as e:  # what sys.exit(code) makes the process's status
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        _IN_PROCESS.pop()
        flags.FLAGS, sys.argv = saved[:2]
        os.environ.clear()
        os.environ.update(saved[2])


def devices_from_argv(argv, default: int = 0, flag: str = "devices") -> int:
    """The value of ``--devices=N`` / ``--devices N`` (or of ``flag``) in ``argv`` (``default`` when absent or not
    an int)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith(f"--{flag}=") else (
            argv[i + 1] if arg == f"--{flag}" and i + 1 < len(argv) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return default
    return default


def force_host_devices(argv, limit: int = MAX_HOST_DEVICES) -> None:
    """Before jax starts a backend: make the CPU platform expose ``--devices`` devices, at most ``limit``
    (the planning tools plan, bench and tune; no effect on GPUs), and at most ``--devices_per_process``."""
    n = min(devices_from_argv(argv), devices_from_argv(argv, limit, "devices_per_process"), limit)
    if n > 1:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"


def define_config_flag(argv: list[str] | None = None, flag_values=None) -> None:
    """``--config=FILE.py[:ARG]`` (ml-collections) with ``--config.SECTION.KEY=VALUE`` overrides;
    default: :mod:`jaxllm.default_config`, every default of :mod:`jaxllm.config`.

    ml-collections reads the default config and the overrides in ``argv`` (default ``sys.argv``)
    already here, so they are checked first: an unknown key, a missing config file or one that
    does not load is one line on stderr and exit status 2 (see :func:`parse_flags`).  The flag goes into
    ``flag_values`` (default absl's global ``FLAGS``).
    """
    from absl import flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    argv = sys.argv if argv is None else argv
    _check_config_args(argv)
    # ml-collections loads each config file as the module "config_config" (the flag's name + "_config") through
    # SourceFileLoader.load_module, which runs a file in the module an earlier load left: a file without
    # get_config() would get the previous file's (a second tool run in this process, jaxllm.cli.run_tool)
    sys.modules.pop("config_config", None)
    try:
        config_flags.DEFINE_config_file("config", os.path.join(os.path.dirname(__file__), "default_config.py"),
                                        "config file, e.g. configs/shakespeare_char.py or configs/gpt3.py:GPT125M",
                                        flag_values=flags.FLAGS if flag_values is None else flag_values)
    except Exception as e:  # noqa: BLE001  the default config with the overrides failed to load
        fail(f"config error: {_file_error(e)}")


def _check_config_args(argv) -> None:
    """Each ``--config.SECTION.KEY`` must be a key users can set, and ``--config`` must name a file."""
    from jaxllm import config  # noqa: PLC0415

    for arg in argv[1:]:
        if arg.startswith("--config."):
            key, _, value = arg[len("--config."):].partition("=")
            try:
                config.check_key(key, value)
            except ConfigError as e:
                fail(e)
    path = config_arg(argv)
    if path is not None and not os.path.isfile(path.split(":", 1)[0]):
        fail(f"config error: --config={path}: no such file {path.split(':', 1)[0]!r}; give a config file such as "
             "configs/shakespeare_char.py, or configs/gpt3.py:GPT125M")


def config_arg(argv) -> str | None:
    """The value of ``--config`` in ``argv`` (``FILE.py[:KEY]``), or None when it is not given."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _config_error(e: BaseException) -> ConfigError | None:
    """The ConfigError a config file raised (an unknown key, a bad type or value, as on the command line), found
    in the chain of what ml-collections raised in its place (it re-raises a file's error as ``type(e)(text)``,
    which a ConfigError's arguments do not fit)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, ConfigError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _file_error(e: BaseException) -> str:
    """One line for a config file that failed to load."""
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__} at line {e.lineno}: {e.msg}; fix the file"
    if isinstance(e, AttributeError) and "get_config" in str(e):
        return "the file defines no get_config(); a config file returns its config from get_config()"
    text = str(e)
    if "Error whilst parsing config file" in text:  # ml-collections puts the traceback in the message
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else text
    else:
        text = f"{type(e).__name__}: {text}"
    return text.splitlines()[0] if text else type(e).__name__


RANK_VARIABLES = ("PALS_RANKID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def first_process() -> bool:
    """Whether the launcher's rank variables (before jax starts) make this process 0, or there are none."""
    return all(os.environ.get(v, "0") == "0" for v in RANK_VARIABLES)


def megatron_key(name: str) -> str | None:
    """What a flag name without ``--config.`` stands for: ``SECTION.KEY``, ``SECTION.KEY=VALUE`` (a
    Megatron switch), or a hint with a space (no flag of jaxllm is that one); None: no key.

    Megatron-LM / Megatron-DeepSpeed names (:data:`jaxllm.errors.MEGATRON_NAMES`, dashes or
    underscores) first, then a key name that one section alone has (``lr`` -> ``train.lr``).
    """
    from jaxllm import config  # noqa: PLC0415

    name = name.replace("-", "_")
    if name in MEGATRON_NAMES:
        return MEGATRON_NAMES[name]
    owners = [section for section, holder in config.Config().sections().items()
              if name in holder.__dataclass_fields__ and not holder.__dataclass_fields__[name].metadata.get("derived")]
    return f"{owners[0]}.{name}" if len(owners) == 1 else None


def _megatron_args(argv: list[str], known) -> tuple[list[str], list[tuple[str, str, str]]]:
    """``argv`` without the Megatron-style flags (``--micro-batch-size=4``, ``--micro-batch-size 4``,
    ``--bf16``, ``--data-path 0.3 A 0.7 B``: a text key takes every word up to the next flag) that name
    a config key and no flag of the tool, and those as ``(key, value, as typed)``.
    A flag that means a key but cannot be taken as it is one line and exit status 2 with the flag to use."""
    from jaxllm import config  # noqa: PLC0415

    kept, taken, i = [argv[0]], [], 1
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, eq, value = arg[2:].partition("=")
        flag = name.replace("-", "_")
        if (not arg.startswith("--") or name.startswith("config") or flag in known
                or (flag.startswith("no") and flag[2:] in known)):
            kept.append(arg)
            continue
        target = megatron_key(name)
        if target is None:
            kept.append(arg)  # absl says it is unknown
            continue
        if " " in target:
            fail(f"error: --{name} (Megatron-DeepSpeed's) has no one flag in jaxllm: set {target} with "
                 f"--config.{target.split()[0]}=VALUE")
        key, fixed, fixed_value = target.partition("=")
        kind = config.key_type(key)
        if not eq and not fixed and kind is not bool and i < len(argv) and not argv[i].startswith("--"):
            value, eq = argv[i], "="  # Megatron's argparse form: --micro-batch-size 4
            i += 1
            while kind is str and i < len(argv) and not argv[i].startswith("--"):  # --data-path 0.3 A 0.7 B
                value += " " + argv[i]
                i += 1
        typed = f"--{name}{eq}{value}"
        if fixed:  # a switch: --bf16 -> model.dtype=bfloat16
            if eq and value.lower() not in ("true", "1", "yes"):
                fail(f"error: {typed}: Megatron's switch for --config.{target}; leave it out, or pass "
                     f"--config.{key}=VALUE")
            value = fixed_value
        elif not eq:
            if kind is not bool:
                fail(f"error: --{name} needs a value: it is Megatron's flag for --config.{key}=VALUE "
                     f"({config.type_name(key)})")
            value = "True"  # Megatron's store_true switches: --sequence-parallel
        try:
            config.override(config.get_config(), key, value)
        except ConfigError as e:
            fail(f"error: {typed} is Megatron's flag for --config.{key}, whose value {e.fix}; pass "
                 f"--config.{key}=VALUE")
        options = config.choices(key)
        if options and config.key_type(key)(value) not in options:
            fail(f"error: {typed} is Megatron's flag for --config.{key}, whose value must be one of "
                 f"{', '.join(map(str, options))} (jaxllm's names); pass --config.{key}=VALUE")
        if any(a.startswith(f"--config.{key}=") for a in argv):
            fail(f"error: {typed} and --config.{key} both set {key}; give it once")
        taken.append((key, value, typed))
    # Megatron's --tokenizer-model is the file that --tokenizer-type's class reads; jaxllm's data.tokenizer is the file
    if any(t.replace("_", "-").startswith("--tokenizer-model") for _, _, t in taken):
        taken = [x for x in taken if not x[2].replace("_", "-").startswith("--tokenizer-type")]
    return kept, taken


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing where every mistake is one line on stderr and exit status 2.

    Before absl sees them, each ``--config.SECTION.KEY`` is checked against the schema
    (an unknown key names the closest one, or the jaxllm key for a Megatron-DeepSpeed name)
    and the config file must exist; a config file that does not load, an override that does
    not parse as its key's type and an unknown flag are reported in one line too.
    ``--some-flag`` is accepted for ``--some_flag`` (not for ``--config.*``).  A Megatron-LM flag
    that is no flag of the tool but names a config key (:func:`megatron_key`), as
    ``--micro-batch-size=4`` or ``--micro-batch-size 4``, is taken as ``--config.train.micro_batch_size=4``
    with a note on stdout (process 0); one that cannot be (another meaning, a value jaxllm names
    otherwise) is one line naming the ``--config.*`` flag to use.  Use as
    ``app.run(main, flags_parser=parse_flags)``.
    """
    from absl import flags  # noqa: PLC0415

    from jaxllm import config  # noqa: PLC0415

    _check_config_args(argv)
    taken = []
    if "config" in flags.FLAGS:
        argv, taken = _megatron_args(argv, flags.FLAGS)
    fixed = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--") and not arg.startswith("--config"):
            flag, eq, value = arg[2:].partition("=")
            arg = "--" + flag.replace("-", "_") + eq + value
        fixed.append(arg)
    path = config_arg(argv)
    try:
        rest = flags.FLAGS(fixed)
        for key, value, typed in taken:
            config.override(flags.FLAGS.config, key, value)
            if first_process():
                print(f"note: {typed} (Megatron's) taken as --config.{key}={value}", flush=True)
        return rest
    except flags.IllegalFlagValueError as e:
        text = str(e)
        if text.startswith("flag --config."):  # an override that does not parse as its key's type
            key, _, rest = text[len("flag --config."):].partition("=")
            value = rest.split(":", 1)[0]
            fail(ConfigError(key, value, f"must be {config.type_name(key)}"))
        if path is not None and text.startswith("flag --config="):
            fail(_config_error(e) or f"config error: --config={path}: {_file_error(e.__cause__ or e)}")
        fail(f"error: {text}")
    except flags.Error as e:
        fail(f"error: {e}")
    except Exception as e:  # noqa: BLE001  the config file itself raised while loading
        if path is None:
            raise
        fail(f"config error: --config={path}: {_file_error(e)}")


def stand_in_processes(num_devices: int, per_process: int) -> None:
    """Before jax starts a backend: let jax see ``num_devices`` CPU devices, this process's ``per_process``
    (its ``--xla_force_host_platform_device_count``) and the rest on stand-in processes, to compile for them.

    Starts a ``jax.distributed`` job of ``ceil(num_devices / per_process)`` processes on a free local port
    (gloo collectives) in which this process is process 0 and the others are stand-ins: clients of the job's
    coordination service, in this process, that publish their devices as the processes of a real job do
    (each a ``LocalTopologyProto`` of ``per_process`` devices, xla/pjrt/distributed/protocol.proto, under
    the CPU client's key ``local_topology/cpu/<process>``), numbered as XLA:CPU numbers a process's devices
    (:data:`MAX_HOST_DEVICES`).  An SPMD program compiles to the same per-device program on any process: this
    one's compile is the full mesh's, with a thread per local device only.  Nothing may run on the devices
    (the stand-ins execute nothing).  At the exit the stand-ins leave the job with this process (jax's
    shutdown barrier); :func:`exit_now` skips it.

    Raises:
      ValueError: ``per_process`` is not 1 to :data:`MAX_HOST_DEVICES`, makes more than
        :data:`MAX_STAND_INS` processes, or is not this process's device count; the job did not start; or
        this jaxlib's CPU client took the stand-ins' devices differently (their count or numbering).
    """
    import jax  # noqa: PLC0415

    processes = _process_count(num_devices, per_process)
    address = _free_address()
    failures = _start_stand_ins(address, num_devices, per_process, processes)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(address, num_processes=processes, process_id=0, initialization_timeout=60)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--devices={num_devices}: the stand-in processes did not start: "
                         f"{_first_line(failures[0] if failures else e)}") from None
    atexit.register(_leave_job)
    _check_stand_in_devices(num_devices, per_process)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0]  # XLA's errors run to pages


def _process_count(num_devices: int, per_process: int) -> int:
    """The job's processes for ``num_devices`` at ``per_process`` each; ValueError where that cannot be."""
    if not 1 <= per_process <= MAX_HOST_DEVICES:
        raise ValueError(f"--devices_per_process={per_process}: give 1 to {MAX_HOST_DEVICES} (XLA:CPU's most in one "
                         "process)")
    processes = -(-num_devices // per_process)
    if processes - 1 > MAX_STAND_INS:
        raise ValueError(f"--devices_per_process={per_process}: {num_devices} devices make {processes} processes; "
                         f"give at least {-(-num_devices // (MAX_STAND_INS + 1))} (at most {MAX_STAND_INS} stand-ins)")
    return processes


def _free_address() -> str:
    """``127.0.0.1:PORT`` with a port free now, for the job's coordination service."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _proto(*fields) -> bytes:
    """Protobuf's wire format of ``(number, int | bytes)`` fields."""
    def varint(n):
        out = bytearray()
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(out + bytes([n]))
    return b"".join(varint(k << 3) + varint(v) if isinstance(v, int) else varint(k << 3 | 2) + varint(len(v)) + v
                    for k, v in fields)


def _boot_id() -> bytes:
    """This host's boot id (one host, as in a job of processes on one machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:  # not Linux: XLA publishes an empty boot id there
        return b""


def _topology(process: int, count: int, boot_id: bytes) -> bytes:
    """A LocalTopologyProto {node_id 1, boot_id 2, devices 3}, each a DeviceProto {local_device_ordinal 1,
    global_device_id 4, device_kind 8, to_string 9, debug_string 10}, as XLA:CPU's processes publish them."""
    first = process * MAX_HOST_DEVICES
    devices = [(3, _proto((1, i), (4, d), (8, b"cpu"), (9, f"CpuDevice(id={d})".encode()),
                          (10, f"cpu:{d}".encode()))) for i, d in enumerate(range(first, first + count))]
    return _proto((1, process), (2, boot_id), *devices)


def _start_stand_ins(address: str, num_devices: int, per_process: int, processes: int) -> list:
    """Starts processes 1 .. ``processes - 1`` as threads that join the job at ``address`` and publish their
    devices; returns the list their failures are appended to (read once the job started or failed)."""
    from jax._src.lib import _jax  # noqa: PLC0415  the client jax.distributed makes for each process

    boot_id, failures = _boot_id(), []

    def stand_in(process: int, count: int) -> None:
        try:
            client = _jax.get_distributed_runtime_client(address, process, init_timeout=60)
            client.connect()  # returns once every process of the job has connected
            client.key_value_set_bytes(f"cpu:local_topology/cpu/{process}", _topology(process, count, boot_id))
        except Exception as e:  # noqa: BLE001  said by the caller, in one line
            failures.append(e)
            return
        _LEAVE.wait()  # a dropped client would leave the job
        client.shutdown()

    for process in range(1, processes):
        count = min(per_process, num_devices - process * per_process)
        _STAND_INS.append(threading.Thread(target=stand_in, args=(process, count), daemon=True))
        _STAND_INS[-1].start()
    return failures


def _leave_job() -> None:
    """At the exit, before jax's own hook (registered before this one): the whole job shuts down. The
    stand-ins' threads were started before (Python 3.12 starts no thread once the interpreter is exiting)."""
    import jax  # noqa: PLC0415

    _LEAVE.set()
    jax.distributed.shutdown()  # this process's client meets the stand-ins' at the job's shutdown barrier
    for t in _STAND_INS:
        t.join()
    _STAND_INS.clear()


def _check_stand_in_devices(num_devices: int, per_process: int) -> None:
    """ValueError unless jax sees ``per_process`` local and ``num_devices`` devices in all, numbered as XLA:CPU
    looks them up (checked by a compile over every device)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    if jax.local_device_count() != per_process:
        raise ValueError(f"--devices_per_process={per_process}: this process has {jax.local_device_count()} CPU "
                         "devices (--xla_force_host_platform_device_count in XLA_FLAGS)")
    devices = jax.devices()
    if len(devices) != num_devices:
        raise ValueError(f"--devices={num_devices}: with stand-in processes jax sees {len(devices)} CPU devices; "
                         f"plan at most {MAX_HOST_DEVICES} devices")
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    try:
        jax.jit(lambda x: x.sum()).lower(jax.ShapeDtypeStruct((len(devices),), "float32", sharding=(
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))))).compile()
    except Exception as e:  # noqa: BLE001  jaxlib's error, said in one line below
        raise ValueError(f"--devices={num_devices}: compiling for them on stand-in processes failed "
                         f"({_first_line(e)}): this jaxlib's CPU client numbers the devices of other processes "
                         f"differently; plan at most {MAX_HOST_DEVICES} devices") from None
