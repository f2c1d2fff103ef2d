"""One attempt of a launched job: a coordination service and K workers, watched until they leave.

`spare_jax.launch` runs the program (flags, relaunches); a `Job` is one
attempt of it. It starts the workers (here, or as one ``srun`` step), copies
each one's output to its log, acts on their events (a worker declared dead is
killed; a worker that stopped while its peers wait for it is evicted,
`spare_jax.launch_watch`), says in one line why each worker died, and decides
how the attempt ended (`Job.wait`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from spare_jax import errors, multihost, runlog
from spare_jax import launch_slurm as slurm
from spare_jax import launch_watch as watch_lib
from spare_jax.launch_spares import Spares
from spare_jax.launch_worker import NOT_A_VERDICT, Options, Worker, free_port, popen, say

__all__ = ["Job", "Options", "Worker", "say"]

# The runtime's own log lines (Gloo's connection notes, absl/XLA's I/W/E/F lines): never
# a worker's last word, which is its error.
_RUNTIME_LOG = re.compile(r"^(\[Gloo\]|[IWEF]\d{4} \d\d:\d\d)")


class Job:
    """One attempt: a coordination service and K workers, watched until they all leave."""

    def __init__(self, command: Sequence[str], options: Options, env: dict):
        self.options, self.k = options, options.processes
        self.port = free_port()
        self.service = multihost.serve(self.port, self.k, options.heartbeat_s)
        self.progress = time.time()
        self.progress_at = 0.0  # when the last progress event came
        self.gaps: list[float] = []  # seconds between progress events (about a step, or 1 s)
        self.resumed = False
        self.preempted_at: float | None = None
        self._said: set[str] = set()
        self.watch = watch_lib.Watch(
            options.evict_after_s, options.evict_steps, options.collective_timeout_s
        )
        self.stopping = False  # the launcher is killing what is left: no more death lines
        self._lock = threading.Lock()
        self._watchers: list[threading.Thread] = []
        self.srun: subprocess.Popen | None = None
        self.spares: Spares | None = None  # warm spares (local scheduler)
        host = "localhost" if options.scheduler == "local" else slurm.coordinator_host()
        job_env = {
            **env,
            multihost.ENV["coordinator"]: f"{host}:{self.port}",
            multihost.ENV["num_processes"]: str(self.k),
        }
        logs = [os.path.join(options.log_dir, f"worker-{i}.log") for i in range(self.k)]
        self.workers = [Worker(i, logs[i]) for i in range(self.k)]
        self.command, self.job_env = list(command), job_env
        self.replacements = 0
        self.injected: set[int] = set()  # indices whose --kill fired (a replacement's included)
        # This attempt's step, by name: the end of an attempt cancels it and nothing else.
        self.step_name = f"spare_jax-{os.getpid()}-{self.port}"
        if options.scheduler == "slurm":
            self.srun = popen([*slurm.command(self.k, options, self.step_name), *command], job_env)
            self._start(self._watch_srun)
            return
        for worker in self.workers:
            self._spawn(worker, {})
        if options.spares:  # started after the workers: they never compete with them to start
            self.spares = Spares(
                options.spares, command, job_env, options.log_dir, self._line, self._close_logs
            )

    def _spawn(self, worker: Worker, extra: dict[str, str]) -> None:
        """Start one worker here, or (a replacement under SLURM) as a one-task srun step."""
        env = {**self.job_env, multihost.ENV["process_id"]: str(worker.index), **extra}
        started = multihost.ENV["started_at"]
        env[started] = repr(time.time())
        if self.options.scheduler == "slurm":
            worker.srun = True
            step = slurm.replacement(self.options, self.step_name)
            worker.proc = popen([*step, *self.command], env)
            worker.watcher = self._start(self._watch_replacement, worker)
            return
        replacing = multihost.ENV["replacement"] in extra
        if replacing and self.spares is not None:
            mine = {k: env[k] for k in (*extra, multihost.ENV["process_id"], started)}
            if self.spares.take(worker, mine):
                return
        worker.proc = popen(self.command, env)
        worker.watcher = self._start(self._watch, worker)

    def _replace_due(self, now: float) -> None:
        """Start a replacement for each worker gone ``replace_after_s`` since the job lost it.

        Only while the run goes on (nobody finished); the replacement joins the
        running job (`spare_jax.rejoin`) with the same process id.
        """
        if any(w.code == 0 for w in self.workers):
            return
        for i, w in enumerate(self.workers):
            if not (w.declared_dead and w.code is not None):
                continue
            if w.gone_at is None:
                w.gone_at = now
            if now - w.gone_at < self.options.replace_after_s:
                continue
            new = Worker(i, w.log_path, replaces_step=w.dead_step)
            kills = self.job_env.get(multihost.ENV["kills"], "")
            mine = [k for k in kills.split(",") if k and not k.startswith(f"{i}=")]
            self.workers[i] = new
            self.replacements += 1
            say(
                f"starting a replacement for worker {i} (declared dead during step "
                f"{w.dead_step}): it joins the running job"
            )
            self._spawn(
                new,
                {
                    multihost.ENV["replacement"]: str(self.replacements),
                    multihost.ENV["kills"]: ",".join(mine),
                },
            )

    def _start(self, target, *args) -> threading.Thread:
        watcher = threading.Thread(target=target, args=args, daemon=True)
        watcher.start()
        self._watchers.append(watcher)
        return watcher

    # ---------------------------------------------------------------- output

    def _watch(self, worker: Worker) -> None:
        """Copy a worker's output to its log, acting on its events and relaying its notices.

        The pipe is always drained, even when the log cannot be written (a
        full disk): a worker must never block on its own output.
        """
        logs: dict[int, Any] = {}
        for line in worker.proc.stdout:
            self._line(worker, line, logs)
        self._close_logs(logs)

    def _watch_srun(self) -> None:
        """The same for every task of the srun step (``--label``: each line says whose it is)."""
        logs: dict[int, Any] = {}
        tasks = list(self.workers)  # the step's own: a replacement is a step of its own
        for line in self.srun.stdout:
            label, sep, rest = line.partition(": ")
            if sep and label.strip().isdigit() and int(label) < self.k:
                self._line(tasks[int(label)], rest, logs)
                continue
            report = slurm.task_report(line)
            if report:
                for i in report[0]:
                    if i < self.k:
                        tasks[i].exit_code = report[1]
        self.srun.wait()
        for w in tasks:  # srun names only the tasks that did not exit 0
            if w.exit_code is None:
                w.exit_code = self._unreported(w, self.srun)
        self._close_logs(logs)

    def _watch_replacement(self, worker: Worker) -> None:
        """A SLURM replacement's step: its output, then its status from srun's report."""
        logs: dict[int, Any] = {}
        reported = None
        for line in worker.proc.stdout:
            report = slurm.task_report(line)
            if report:
                reported = report[1]
                continue
            self._line(worker, line, logs)
        worker.proc.wait()
        if reported is None:
            reported = self._unreported(worker, worker.proc)
        worker.exit_code = reported
        self._close_logs(logs)

    def _unreported(self, w: Worker, srun: subprocess.Popen) -> int:
        """The status of a task of the step ``srun`` that srun's report did not name.

        A step that exits 0 names none; after a failed step, a task counts as
        having exited 0 only when it said so (its ``exit`` or ``finished`` event):
        a report line lost or garbled must never turn a broken attempt into a
        complete one.
        """
        if srun.returncode == 0:
            return 0
        if w.said_status is not None:
            return w.said_status
        if w.finished:
            return 0
        if not (w.lost or self.stopping):
            say(
                f"srun did not report worker {w.index}'s exit status and it never said it "
                "finished: counted as a crash"
            )
        return -9

    def _line(self, worker: Worker, line: str, logs: dict[int, Any]) -> None:
        log = logs.get(worker.index, False)
        if log is False:
            log = logs[worker.index] = self._open_log(worker)
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as err:
                say(f"cannot write {worker.log_path} ({err.strerror}): no more of its log")
                logs[worker.index] = None
        event = line.find(runlog.EVENT)  # mid-line when the user's output had no newline yet
        if event >= 0:
            self._on_event(worker, line[event + len(runlog.EVENT) :])
        elif line.startswith(runlog.NOTICE):
            self._relay(worker, line[len(runlog.NOTICE) :].strip())
        elif line.strip() and not _RUNTIME_LOG.match(line):
            worker.last_line = line.strip()
            worker.tail.feed(line)

    @staticmethod
    def _open_log(worker: Worker) -> Any:
        try:
            return open(worker.log_path, "a", encoding="utf-8")
        except OSError as err:
            say(f"cannot write {worker.log_path} ({err.strerror}): its output is not kept")
            return None

    @staticmethod
    def _close_logs(logs: dict[int, Any]) -> None:
        for log in logs.values():
            if log:
                try:
                    log.close()
                except OSError:
                    pass

    def _relay(self, worker: Worker, message: str) -> None:
        worker.last_line = message
        with self._lock:  # survivors say the same thing: once is enough
            if message in self._said:
                return
            self._said.add(message)
        say(f"[worker {worker.index}] {message}")

    def _on_event(self, worker: Worker, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError:
            return
        kind = event.get("kind")
        now = time.time()
        if kind == "progress" and self.progress_at:
            self.gaps.append(now - self.progress_at)
        self.progress = now
        if kind == "progress":
            self.progress_at = now
        if kind == "save_barriers":
            worker.save_wait_s = float(event.get("wait_s", 0.0))
        if kind == "at":  # where it is: the hung-worker watch
            step, phase = int(event.get("step", -1)), str(event.get("phase", ""))
            if not (worker.declared_dead or worker.evicted):
                self.watch.seen(worker.index, step, phase, float(event.get("step_s", 0)), now)
            if phase in runlog.STEP_PHASES:
                worker.reached = step
        elif kind == "kill_point":  # the fault injector: the worker kills itself now
            worker.injected = True
            self.injected.add(worker.index)
        elif kind == "hello":
            worker.pid, worker.host = event.get("pid"), event.get("host", "")
        elif kind == "dead":
            step = int(event.get("step", -1))
            for p in event.get("processes", []):
                w = self.workers[p] if 0 <= p < self.k else None
                if w is None or w.declared_dead or step <= w.replaces_step:
                    continue  # a survivor's report of a loss already acted on
                w.declared_dead, w.dead_step = True, step
                w.send(signal.SIGKILL)  # hung or stopped: it goes now
        elif kind == "resumed":
            self.resumed = True
        elif kind == "exit":
            worker.said_status = int(event.get("status", 1))
            worker.said_line = str(event.get("line", ""))
        elif kind == "finished":
            worker.finished = True

    # ------------------------------------------------------------------ wait

    def preempt(self) -> None:
        """Pass a preemption notice on: SIGTERM to every worker (they save and leave)."""
        if self.preempted_at is None:
            self.preempted_at = time.time()
            if self.srun is not None and self.srun.poll() is None:
                self.srun.send_signal(signal.SIGTERM)  # srun passes it on to every task
            for w in self.workers:
                w.send(signal.SIGTERM)

    def wait(self, stop: threading.Event | None = None) -> str:
        """Block until the job is over: ``complete``, ``failed`` (a crash the job did not
        mask), ``verdict``, ``relaunch``, ``hung`` or ``preempted`` (``stop`` is set when a
        SIGTERM reaches the launcher)."""
        first_exit = verdict_at = None
        while True:
            if stop is not None and stop.is_set():
                self.preempt()
            self._tell_deaths()  # before a replacement takes the dead one's place
            if self.options.replace_after_s is not None and self.preempted_at is None:
                self._replace_due(time.time())
            codes = [w.code for w in self.workers]
            if self.preempted_at is None and errors.EXIT_PREEMPTED in codes:
                self.preempted_at = time.time()  # the scheduler told the workers directly
            if self.preempted_at is not None:
                if all(c is not None for c in codes):
                    return "preempted"
                if time.time() - self.preempted_at > self.options.preempt_s:
                    say(
                        f"workers still running {self.options.preempt_s:.0f} s after the "
                        "preemption notice: killed"
                    )
                    self.kill()
                    return "preempted"
                time.sleep(0.05)
                continue
            if any(c is not None and c not in NOT_A_VERDICT and c > 0 for c in codes):
                # The others reach the same verdict (a bad batch, no usable checkpoint)
                # and each log says so, unless they take longer than `verdict_s`.
                verdict_at = verdict_at or time.time()
                if None in codes and time.time() - verdict_at < self.options.verdict_s:
                    time.sleep(0.05)
                    continue
                self.kill()
                return "verdict"
            running = [w for w in self.workers if w.code is None]
            done = [w for w in self.workers if w.code == 0 and not w.lost]
            if not running:
                return self._ended(done)
            now = time.time()
            self._evict(now)
            left = [w for w in self.workers if w.left_alone]
            if not left:
                first_exit = None
            elif first_exit is None:
                first_exit = now
            if first_exit is not None and now - first_exit > self.options.grace_s + self._saving():
                for w in running:
                    say(
                        f"worker {w.index} still running {self.options.grace_s:.0f} s after "
                        "another left: killed"
                    )
                self.kill()
                return self._ended(done)
            if self._stuck_after_a_loss(now):
                say(
                    "a worker died and the others have made no progress since: they cannot "
                    "rebuild without it (a loss during their recovery); relaunching"
                )
                self.kill()
                return "relaunch"
            if now - self.progress > self.options.hang_timeout_s:
                say(
                    f"no worker made progress for {self.options.hang_timeout_s:.0f} s: "
                    "the job counts as hung"
                )
                self.kill()
                return "hung"
            time.sleep(0.05)

    def _ended(self, done: list[Worker]) -> str:
        """Every worker gone: ``complete``, ``failed`` (a crash the job did not mask) or
        ``relaunch`` (nobody finished)."""
        if not done:
            return "relaunch"
        unmasked = [w for w in self.workers if w.failed and not (w.lost or w.stopped)]
        for w in unmasked:
            say(
                f"worker {w.index} ended with {watch_lib.status_name(int(w.code or 0))} and the "
                "job did not go on without it (it was never declared dead): the run is not "
                "complete"
            )
        return "failed" if unmasked else "complete"

    def _tell_deaths(self) -> None:
        """One line for each worker that died since the last look: how, why, its log."""
        if self.stopping:
            return
        for w in self.workers:
            code = w.code
            if w.told or code is None or code in (0, errors.EXIT_RELAUNCH, errors.EXIT_PREEMPTED):
                continue
            if code not in NOT_A_VERDICT and code > 0:
                continue  # a verdict: said once, as the job's outcome
            if w.watcher is not None:
                w.watcher.join(timeout=2.0)  # its last lines (a traceback) first
            w.told = True
            self.watch.forget(w.index)
            if w.injected:
                cause = "the fault injector (--kill)"
            elif w.declared_dead:
                cause = f"declared dead by the job during step {w.dead_step}"
            elif code == multihost.EXIT_DECLARED_DEAD:
                cause = "declared dead by the job (no heartbeat in time)"
            elif code == errors.EXIT_GROUP_LOST:
                cause = "left: another process of its group died (the job masks the group)"
            else:
                cause = ""
            say(watch_lib.death_line(w.index, code, cause, w.tail.last, w.log_path))

    def _evict(self, now: float) -> None:
        """Kill each worker that stopped while its peers wait for it (`launch_watch.Watch`).

        The job then loses it as it would a killed one: the survivors' live-set
        check sees it gone one heartbeat later and they go on without it.
        """
        live = [w.index for w in self.workers if w.code is None and not w.lost and not w.evicted]
        for index, reason in self.watch.stuck(now, live):
            w = self.workers[index]
            w.evicted, w.declared_dead, w.told = reason, True, True
            w.dead_step = self.watch.positions[index].step
            self.watch.forget(index)
            say(f"worker {index} evicted: {reason}; killed (SIGKILL); log: {w.log_path}")
            w.send(signal.SIGKILL)

    def signatures(self) -> dict[int, watch_lib.Signature]:
        """This attempt's crashes the job did not mask, by worker (for telling a repeat)."""
        return {
            w.index: w.signature() for w in self.workers if w.failed and not (w.lost or w.stopped)
        }

    def _stuck_after_a_loss(self, now: float) -> bool:
        """A worker died (not declared dead by the job) and nobody has made progress since.

        Survivors see a loss within the heartbeat and the collective timeouts
        and then make progress again; a death while they rebuild their
        collectives can leave them waiting on it for good. Allowed: four
        heartbeats, one collective timeout and three typical steps, and the
        barrier wait of a sharded save the survivors are in (`_saving`).
        """
        died = [w for w in self.workers if w.code is not None and w.code < 0 and not w.lost]
        if not died or any(w.code == 0 for w in self.workers):
            return False
        gaps = sorted(self.gaps[-20:])
        step_s = gaps[len(gaps) // 2] if gaps else 1.0
        allowed = 4 * self.options.heartbeat_s + self.options.collective_timeout_s + 3 * step_s
        return now - self.progress > allowed + self._saving()

    def _saving(self) -> float:
        """How long survivors in a sharded save may still wait at its barriers for a lost peer
        before they drop the save and go on (0 when none is saving): two barriers in a row
        can each run out, the background write's and the commit's."""
        at = self.watch.positions
        saving = [w for w in self.workers if w.code is None and w.index in at]
        waits = [w.save_wait_s for w in saving if at[w.index].phase == "checkpoint"]
        return 2 * max(waits, default=0)

    def verdict(self) -> tuple[int, str]:
        """The first worker verdict: its status and its last line."""
        for w in self.workers:
            c = w.code
            if c is not None and c not in NOT_A_VERDICT and c > 0:
                said = w.said_line if w.said_status == c else ""  # not an earlier run's
                return c, said or w.last_line
        return 1, ""

    def kill(self) -> None:
        """SIGKILL every worker still running (JAX catches SIGTERM) and stop the service."""
        self.stopping = True
        if self.spares is not None:
            self.spares.kill()
        for w in self.workers:
            w.stopped = w.stopped or w.code is None
        for w in self.workers:
            w.send(signal.SIGKILL)
        if self.srun is not None and self.srun.poll() is None:
            slurm.cancel(self.step_name)
            self.srun.kill()
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        if self.srun is not None:
            try:
                self.srun.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for watcher in self._watchers:  # their last lines (a kill point, a notice) count
            watcher.join(timeout=5)
        if self.service is not None:
            self.service.shutdown()
            self.service = None
