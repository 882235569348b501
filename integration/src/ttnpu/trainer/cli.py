"""``ttnpu-train``: train a registered recipe; every run writes under one run folder.

    ttnpu-train                                # dsv4_debug, bundled corpus, cpu without accelerator
    ttnpu-train --config dsv4_small --training.steps 50
    ttnpu-train --resume runs/20261202-113000  # continue that run from its newest checkpoint
    ttnpu-train --replicas 2                   # two torchft replica groups and a Lighthouse

A run folder (``<dump_folder>/<timestamp or --run-name>/``, default ``runs/``) holds
``command.json`` (the recipe and overrides it was started with), ``checkpoint/step-N/`` and ``tb/``
(TensorBoard). ``--resume`` reuses the saved recipe and overrides, with any new overrides applied on
top. Without a launcher the process is a one-rank job (``RANK``/``WORLD_SIZE``/``MASTER_*`` set
here); under torchrun its environment is used and ``--run-name`` gives all ranks one folder.
``--replicas N`` runs N replica groups as processes around a Lighthouse that it starts and
restarts (or ``--lighthouse URL``; :mod:`ttnpu.trainer.launcher`), each in ``<run>/replica_<i>/``
under a torchrun agent that restarts it when it dies (``--max-restarts``, default 3). A process
that torchelastic restarted (``TORCHELASTIC_RESTART_COUNT`` > 0) with the same ``--run-name``
continues in that run folder: it loads the newest checkpoint there, if any, and heals from a live
replica.

Every option is checked before anything is built or written (:mod:`ttnpu.trainer.validation`):
a bad one exits 2 with one line naming it and what was expected, and leaves no run folder.
Under fault tolerance each log line carries its replica id; torchft's own logs (its Python
loggers and its Rust ``RUST_LOG``) stay at WARNING unless ``--torchft-logs``.

SIGTERM or SIGINT (Ctrl-C) asks for a stop: every rank and replica agree on it in the next step's
vote, finish that step, write a full checkpoint of it and exit 0 with one line ("stopped by SIGTERM
at step N; checkpoint <path>"); a second SIGINT exits at once (130). ``--supervisor-pid`` (given
by ``--replicas`` to its replicas) stops the process the same way when that supervisor is gone.

Exit status: 0 when training finished or stopped on request; 2 for a bad command line, config or
checkpoint; 3 (``EXIT_PERSISTENT_SDC``) for a replica taken out by a persistent silent data
corruption; 4 (``EXIT_SPLIT_BRAIN``) for a replica group whose weights differ from the majority's;
5 (``EXIT_LIGHTHOUSE_LOST``) for a replica that found no Lighthouse for its quorum timeout and
left with a checkpoint of its last committed step (all three recorded in the run folder's
``left.json``, so a torchelastic restart does not bring the replica back);
1 for a replica whose supervisor vanished and that could not stop within
``ORPHAN_GRACE_SECONDS``, and for a loss spike that no checkpoint before its onset can undo (on
no replica); 130 for a second SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# torch, torchtitan and the recipes are imported once the command line asks for them: --help
# and a bad flag answer at once
from .run_folder import CheckpointError

if TYPE_CHECKING:
    from torchtitan.config import ConfigManager

__all__ = ["OneLineParser", "UsageError", "main"]

DEFAULT_CONFIG = "dsv4_debug"
_COMMAND_FILE = "command.json"
_AC_CHOICE = re.compile(r"activation[-_]checkpoint:")
_AC_OPTION = re.compile(r"--activation[-_]checkpoint\.")
_HELP_HINT = "every option: ttnpu-train --help-config"
_TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
ORPHAN_GRACE_SECONDS = 10.0
"""How long a replica whose supervisor vanished may take to stop cleanly before it exits at once
(its step may wait on a Lighthouse that died with the supervisor)."""


class UsageError(Exception):
    """A bad command line or config: reported in one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`UsageError` (one line, no usage block)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ttnpu-train",
        description="Train DeepSeek-V4 with torchtitan; any other --section.key VALUE is a "
        "torchtitan config override (see --help-config).",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action="help", help="show this help and exit")
    parser.add_argument("--config", help=f"recipe name (default {DEFAULT_CONFIG})")
    parser.add_argument("--resume", type=Path, metavar="RUN_FOLDER", help="continue a run")
    parser.add_argument(
        "--run-name", help="run folder name under --dump_folder (default: a timestamp)"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="replica groups to start on this host (default 1)"
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="fewest replica groups a step commits with"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="with --replicas: how often torchelastic restarts a dead replica, and the "
        "supervisor a dead Lighthouse (default 3)",
    )
    parser.add_argument(
        "--lighthouse",
        metavar="URL",
        help="with --replicas: a running Lighthouse (http://host:port) instead of starting one",
    )
    parser.add_argument("--list-configs", action="store_true", help="list recipes and exit")
    parser.add_argument(
        "--help-config", action="store_true", help="show every config override and exit"
    )
    parser.add_argument(
        "--supervisor-pid",
        type=int,
        metavar="PID",
        help="stop (with a checkpoint) when process PID has exited",
    )
    parser.add_argument(
        "--torchft-logs",
        action="store_true",
        help="show torchft's own INFO logs (quorums, commits; its Rust side too)",
    )
    return parser


class StopSignals:
    """SIGTERM and SIGINT as a stop request. The first asks the trainer to stop after the current
    step (the handler only sets a flag: nothing is raised inside torch or torchft, whose state a
    KeyboardInterrupt would leave half-changed); one that arrives before the trainer exists is
    handed to it once built. A second SIGINT exits at once."""

    def __init__(self) -> None:
        self.first: str | None = None
        self._trainer: Any = None
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)
        }

    def close(self) -> None:
        """The handlers from before (for callers of :func:`main` in-process)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def attach(self, trainer: Any) -> None:
        self._trainer = trainer
        if self.first is not None:
            trainer.request_stop(self.first)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first = name
            if self._trainer is not None:
                self._trainer.request_stop(name)
            _say(f"{name}: stopping after the current step, with a checkpoint (SIGINT again: "
                 f"exit at once)")  # fmt: skip
        elif signum == signal.SIGINT:
            _say("SIGINT again: exiting at once, without a checkpoint")
            os._exit(128 + signum)


def _say(line: str) -> None:
    """One line on stderr from rank 0, safe inside a signal handler (no buffered I/O)."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"ttnpu-train: {line}\n".encode())


def supervisor_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    with contextlib.suppress(OSError):  # where /proc exists: a zombie is gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def exit_with_supervisor(pid: int) -> None:
    """Stop as on SIGTERM once the supervisor ``pid`` has exited or this process's parent (the
    supervisor, or the torchrun agent between them) has changed, so no replica outlives its
    supervisor. A daemon thread polls: one code path on every POSIX system (Linux's
    ``PR_SET_PDEATHSIG`` is not portable, and sees only the parent). The stop may wait on a
    Lighthouse that died with the supervisor: after ``ORPHAN_GRACE_SECONDS`` the process exits at
    once (status 1; the newest checkpoint stays valid), taking down the torchrun agent between
    them first (it would restart the process)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent and not supervisor_gone(pid):
            time.sleep(0.5)
        _say(f"the supervisor (pid {pid}) is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_SECONDS)
        _say(f"not stopped {ORPHAN_GRACE_SECONDS:.0f} s after the supervisor vanished; exiting")
        if parent != pid and os.getppid() == parent:  # a torchrun agent, which would restart it
            os.kill(parent, signal.SIGTERM)
        os._exit(1)

    threading.Thread(target=watch, name="ttnpu-supervisor-watch", daemon=True).start()


def single_process_env() -> None:
    """A one-rank job unless a launcher (torchrun) already set the rank environment."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _new_run_folder(parent: Path, name: str | None) -> Path:
    """``parent/<name or timestamp>``; ranks of one torchrun job share it through ``--run-name``."""
    if name is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("under torchrun (WORLD_SIZE > 1) pass --run-name for all ranks")
        name = time.strftime("%Y%m%d-%H%M%S")
        while (parent / name).exists():  # two runs started in the same second
            name += "-1"
    run = parent / name
    if (run / _COMMAND_FILE).exists():
        raise UsageError(f"run folder {run} already holds a run; use --resume {run}")
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--dump_folder {parent}: cannot create the run folder ({err})") from err
    return run


def _restarted_run(parent: Path, name: str | None) -> Path | None:
    """The run folder this process trained in before torchelastic restarted it (the same command,
    so the same ``--run-name``); None on a first start."""
    from .launcher import restart_count

    if (restarts := restart_count()) == 0 or name is None:
        return None
    run = parent / name
    if not (run / _COMMAND_FILE).is_file():  # it died before its run had started
        return None
    _say(f"restarted by torchelastic (restart {restarts}); rejoining in {run}")
    return run


def _ac_choice_last(overrides: list[str]) -> list[str]:
    """``overrides`` with the activation-checkpointing choice (torchtitan's subcommand, e.g.
    ``activation_checkpoint:full``) and its ``--activation_checkpoint.*`` options moved to the
    end: tyro applies what follows a subcommand to it alone, so the choice may be given anywhere
    and a resume may add overrides after a saved one. A later choice replaces an earlier one
    together with the options given before it."""
    groups: list[list[str]] = []  # an option with its values, or a choice
    for arg in overrides:
        if arg.startswith("--") or _AC_CHOICE.match(arg) or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    rest: list[str] = []
    choice: list[str] = []
    options: list[str] = []
    for group in groups:
        if _AC_CHOICE.match(group[0]):
            rest += group[1:]
            choice, options = group[:1], []
        elif _AC_OPTION.match(group[0]):
            options += group
        else:
            rest += group
    return [*rest, *choice, *options]


def _plan(
    args: argparse.Namespace, overrides: list[str]
) -> tuple[str, list[str], Path | None, dict[str, int]]:
    """(recipe, overrides, run folder to resume or None, replica layout), from the command line
    and, with ``--resume``, the run folder's ``command.json``."""
    module = next((i for i, a in enumerate(overrides) if re.match(r"--module(=|$)", a)), None)
    if module is not None:
        given = " ".join(overrides[module : module + 2])
        raise UsageError(
            f"{given}: ttnpu-train trains the recipes of ttnpu.trainer (its --module is fixed); "
            "choose one with --config (see --list-configs)"
        )
    if args.replicas < 1 or not 1 <= args.min_replicas <= args.replicas:
        raise UsageError(
            f"--replicas {args.replicas} must be >= 1 and --min-replicas {args.min_replicas} "
            f"in [1, replicas]"
        )
    if args.max_restarts is not None and (args.max_restarts < 0 or args.replicas == 1):
        raise UsageError(
            f"--max-restarts {args.max_restarts}: needs --replicas >= 2 and a value >= 0 (one "
            "replica group under torchrun: give --max-restarts to torchrun)"
        )
    if args.lighthouse is not None and args.replicas == 1:
        raise UsageError(
            f"--lighthouse {args.lighthouse}: needs --replicas >= 2 (one replica group: "
            "--fault_tolerance.enable --fault_tolerance.lighthouse URL)"
        )
    layout = {"replicas": args.replicas, "min_replicas": args.min_replicas}
    if args.resume is None:
        return args.config or DEFAULT_CONFIG, _ac_choice_last(overrides), None, layout
    run = args.resume
    saved_file = run / _COMMAND_FILE
    if not saved_file.is_file():
        raise UsageError(f"--resume {run}: not a run folder (no {_COMMAND_FILE})")
    if not os.access(run, os.W_OK | os.X_OK):
        raise UsageError(f"--resume {run}: the run folder is not writable")
    try:
        saved = json.loads(saved_file.read_text())
        config, saved_overrides = saved["config"], list(saved["overrides"])
        layout = {k: int(saved.get(k, 1)) for k in layout}
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--resume {run}: {saved_file} is corrupt ({err})") from err
    if args.config not in (None, config):
        raise UsageError(f"--resume {run}: the run used --config {config}, not {args.config}")
    return config, _ac_choice_last([*saved_overrides, *overrides]), run, layout


def _run(argv: Sequence[str], signals: StopSignals) -> int:
    args, overrides = _parser().parse_known_args(argv)
    if args.supervisor_pid is not None:
        if supervisor_gone(args.supervisor_pid):  # e.g. torchelastic restarted an orphan
            _say(f"the supervisor (pid {args.supervisor_pid}) is gone; not starting")
            return 0
        exit_with_supervisor(args.supervisor_pid)
    if not args.torchft_logs:
        os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's native side loads
    from .config_registry import CONFIGS

    if args.list_configs:
        for name, fn in CONFIGS.items():
            print(f"{name:16s} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    cli_overrides = overrides
    config_name, overrides, resume, layout = _plan(args, overrides)
    if config_name not in CONFIGS:
        raise UsageError(f"unknown --config {config_name!r}; expected one of {sorted(CONFIGS)}")

    from ttnpu.ft import LighthouseUnreachable

    tyro_args = ["--module", "ttnpu.trainer", "--config", config_name, *overrides]
    if args.help_config:
        tyro_args.append("--help")
    config = _parse_config(tyro_args, CONFIGS[config_name])
    _init_logging(config, torchft_logs=args.torchft_logs)

    if layout["replicas"] > 1:
        if signals.first is not None:  # then the supervisor's own handlers take over
            _say(f"stopped by {signals.first} before the replicas started")
            return 0
        return _launch(
            config_name, overrides, resume, layout, Path(config.dump_folder), args, cli_overrides
        )
    if resume is not None:
        from .run_folder import newest_verified_checkpoint, verify_checkpoint

        # CheckpointError (no checkpoint verifies, or the named one does not) before anything is
        # built or changed; the checkpointer's load walks again, with every rank agreeing.
        checkpoints = config.fault_tolerance.shared_checkpoints(resume) or (
            resume / config.checkpoint.folder
        )
        allow = getattr(config.checkpoint, "allow_unverified", False)
        if config.checkpoint.load_step >= 0:
            step = checkpoints / f"step-{config.checkpoint.load_step}"
            verify_checkpoint(step, allow_unverified=allow)
        else:
            newest_verified_checkpoint(checkpoints, allow_unverified=allow)
        run = resume
    elif (rejoined := _restarted_run(Path(config.dump_folder), args.run_name)) is not None:
        run = resume = rejoined  # the checkpointer loads its newest verified checkpoint, if any
    else:
        run = _new_run_folder(Path(config.dump_folder), args.run_name)
    from .launcher import LEFT_FILE, left_status, restart_count

    if restart_count() and (status := left_status(run)) is not None:
        _say(f"this replica left the job (status {status}); torchelastic's restart ends here")
        return 0  # its agent succeeds and stops restarting it
    (run / LEFT_FILE).unlink(missing_ok=True)  # started anew: it may train again
    config.dump_folder = str(run)
    if not sys.stdout.isatty():
        config.metrics.disable_color_printing = True
    print(f"ttnpu-train: {config_name} -> run folder {run}", flush=True)

    single_process_env()
    try:
        trainer = config.build()
    except BaseException as err:
        if resume is None and os.environ["RANK"] == "0":
            shutil.rmtree(run, ignore_errors=True)  # a run that never started leaves nothing
        if isinstance(err, LighthouseUnreachable):
            raise UsageError(str(err)) from err
        if isinstance(err, ValueError):  # torchtitan and the model validate with ValueError
            raise UsageError(f"invalid config {config_name}: {err}") from err
        raise
    if resume is None and os.environ["RANK"] == "0":
        (run / _COMMAND_FILE).write_text(
            json.dumps({"config": config_name, "overrides": overrides}, indent=2) + "\n"
        )
    signals.attach(trainer)
    status = _train(trainer)
    from .features import EXIT_LIGHTHOUSE_LOST, EXIT_PERSISTENT_SDC, EXIT_SPLIT_BRAIN
    from .launcher import record_left

    if status in (EXIT_PERSISTENT_SDC, EXIT_SPLIT_BRAIN, EXIT_LIGHTHOUSE_LOST):
        record_left(run, status)  # not to be restarted into the job
    return status


def _train(trainer: Any) -> int:
    from ttnpu.ft import LighthouseUnreachable, SplitBrainError
    from ttnpu.routing import NoRollbackTargetError

    from .features import (
        EXIT_LIGHTHOUSE_LOST,
        EXIT_PERSISTENT_SDC,
        EXIT_SPLIT_BRAIN,
        PersistentSDCError,
    )

    try:
        trainer.train()
    except LighthouseUnreachable as err:
        stopped = trainer.stopped or "no checkpoint written"
        left = f"{err}; {stopped}; this replica leaves the job"
        print(f"ttnpu-train: {left}", file=sys.stderr)
        return EXIT_LIGHTHOUSE_LOST
    except PersistentSDCError as err:
        print(f"ttnpu-train: {err}; this replica leaves the job", file=sys.stderr)
        return EXIT_PERSISTENT_SDC
    except SplitBrainError as err:
        print(f"ttnpu-train: {err}", file=sys.stderr)
        return EXIT_SPLIT_BRAIN
    except NoRollbackTargetError as err:
        print(f"ttnpu-train: loss spike with nothing to roll back to: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if trainer.stopped is not None:
        _say(str(trainer.stopped))
    return 0


def _config_manager() -> ConfigManager:
    """torchtitan's ConfigManager whose validation step is :func:`check_config` (which also
    covers its own: the tokenizer folder exists)."""
    from torchtitan.config import ConfigManager

    from .validation import check_config

    class CheckedConfigManager(ConfigManager):
        def _validate_config(self) -> None:
            check_config(self.config)

    return CheckedConfigManager()


def _parse_config(tyro_args: list[str], recipe: Callable[[], Any]) -> Any:
    """The trainer config from torchtitan's parser; its errors as one-line :class:`UsageError`
    (an unknown option with the closest of ``recipe``'s options)."""
    kinds: Any
    try:  # tyro's parse-error hook: a private module (tyro 1.0), so an older tyro may lack it
        from tyro import _errors as kinds
    except ImportError:
        kinds = None

    def one_line(event: Any) -> None:
        message = _describe(event, kinds, recipe)
        if message is not None:  # else tyro's own report (and exit status 2)
            raise UsageError(f"{message} ({_HELP_HINT})")

    hook = kinds.on_parse_error(one_line) if kinds else contextlib.nullcontext()
    try:
        with hook:
            return _config_manager().parse_args(tyro_args)
    except ValueError as err:  # check_config
        raise UsageError(str(err)) from None


def _describe(event: Any, kinds: Any, recipe: Callable[[], Any]) -> str | None:
    """One line for a tyro parse error of the kinds torchtitan's options produce."""
    if isinstance(event, kinds.UnrecognizedArgs):
        flags = [t for t in event.tokens if t.startswith("-")] or event.tokens
        return f"unrecognized option {' '.join(flags)}{_closest_option(flags[0], recipe())}"
    flag = None
    if getattr(event, "argument", None) is not None:
        flag = "--" + event.argument.lowered.dest.replace("-", "_")
    if isinstance(event, kinds.InvalidChoice):
        return f"{flag} {event.value}: expected one of {', '.join(event.choices)}"
    if isinstance(event, kinds.InstantiationFailure | kinds.BadValue):
        what = getattr(event, "message", "a missing or extra value")
        return what if flag is None else f"{flag}: {what}"
    return None


def _option_names(config: Any, prefix: str = "") -> Iterator[str]:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        if dataclasses.is_dataclass(value):
            yield from _option_names(value, f"{prefix}{field.name}.")
        else:
            yield f"--{prefix}{field.name}"


def _closest_option(flag: str, config: Any) -> str:
    name = "--" + flag.lstrip("-").split("=")[0].replace("-", "_")
    close = difflib.get_close_matches(name, list(_option_names(config)), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _init_logging(config: Any, *, torchft_logs: bool) -> None:
    """torchtitan's logger, with the replica id on every line under fault tolerance and
    torchft's own loggers at WARNING unless asked for."""
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    if config.fault_tolerance.enable:
        who = f"replica {config.fault_tolerance.replica_id}"
        for handler in logger.handlers:
            handler.setFormatter(
                logging.Formatter(
                    f"[titan] %(asctime)s - {who} - %(name)s - %(levelname)s - %(message)s"
                )
            )
    for name in _TORCHFT_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if torchft_logs else logging.WARNING)


def _launch(
    config_name: str,
    overrides: list[str],
    resume: Path | None,
    layout: dict[str, int],
    dump_folder: Path,
    args: argparse.Namespace,
    new_overrides: list[str],
) -> int:
    """``--replicas N``: a run folder holding one sub-folder per replica group."""
    from .launcher import DEFAULT_MAX_RESTARTS, launch_replicas

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(
            "--replicas starts its own processes; under torchrun use --fault_tolerance.enable "
            "with TORCHFT_LIGHTHOUSE instead"
        )
    lighthouse = None
    if args.lighthouse is not None:  # checked before the run folder is made
        from ttnpu.ft import LighthouseUnreachable, check_lighthouse

        try:
            lighthouse = check_lighthouse(args.lighthouse)
        except LighthouseUnreachable as err:
            raise UsageError(f"--lighthouse: {err}") from None
    replicas = layout["replicas"]
    forwarded = ["--torchft-logs"] if args.torchft_logs else []
    if resume is not None:
        run = resume
        children = [
            ["--resume", str(run / f"replica_{i}"), *new_overrides, *forwarded]
            for i in range(replicas)
        ]
    else:
        run = _new_run_folder(dump_folder, args.run_name)
        (run / _COMMAND_FILE).write_text(
            json.dumps({"config": config_name, "overrides": overrides, **layout}, indent=2) + "\n"
        )
        children = [
            ["--config", config_name, *overrides, "--dump_folder", str(run),
             "--run-name", f"replica_{i}", *forwarded]
            for i in range(replicas)
        ]  # fmt: skip
    print(f"ttnpu-train: {config_name} x {replicas} replicas -> run folder {run}", flush=True)
    restarts = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
    from ttnpu.ft import LighthouseStartError

    try:
        return launch_replicas(
            run, replicas, layout["min_replicas"], children, restarts, lighthouse
        )
    except LighthouseStartError as err:  # before any replica started
        if resume is None:
            shutil.rmtree(run, ignore_errors=True)
        print(f"ttnpu-train: error: {err}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    signals = StopSignals()  # from the start: a replica stopped while it starts up stops cleanly
    try:
        return _run(sys.argv[1:] if argv is None else argv, signals)
    except (UsageError, CheckpointError) as err:
        print(f"ttnpu-train: error: {err}", file=sys.stderr)
        return 2
    finally:
        signals.close()


if __name__ == "__main__":
    sys.exit(main())
