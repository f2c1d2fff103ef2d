#!/usr/bin/env bash
# .ci/slurm.sh -- a throwaway, real, one-node SLURM cluster for CI.
#
#   eval "$(.ci/slurm.sh up DIR)"   # start it; prints `export SLURM_CONF=DIR/slurm.conf`
#   .ci/slurm.sh down DIR           # cancel jobs, stop every daemon that `up` started
#
# Typical use in a CI job:
#   d=$(mktemp -d); trap '.ci/slurm.sh down "$d"' EXIT
#   eval "$(.ci/slurm.sh up "$d")"
#   srun -n 4 hostname
#
# Everything that the cluster writes lives under DIR:
#   DIR/slurm.conf DIR/plugstack.conf   configuration (clients need SLURM_CONF)
#   DIR/munge/                          munge key, socket, pid, log, seed
#   DIR/state/ DIR/spool/               slurmctld state, slurmd spool
#   DIR/log/ DIR/run/                   daemon logs and pid files
# Nothing is written under /etc except what the Debian packages install themselves.
# The cluster uses its own munged on its own socket (AuthInfo=socket=...), so a
# system munged, if any, is neither used nor disturbed.
#
# Both subcommands are idempotent: `up` on a running cluster only re-checks it;
# `down` on a half-started (or never started) cluster stops whatever is there.
#
# Knobs (environment):
#   SLURM_CI_CPUS         task slots the node offers (default 16, whatever the cores)
#   SLURM_CI_WAIT         seconds `up` waits for the node to become idle (default 60)
#   SLURM_CI_CTLD_PORT    slurmctld port (default 6817)
#   SLURM_CI_SLURMD_PORT  slurmd port    (default 6818)
set -euo pipefail

PROG=slurm.sh
CPUS=${SLURM_CI_CPUS:-16}
WAIT=${SLURM_CI_WAIT:-60}
CTLD_PORT=${SLURM_CI_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_CI_SLURMD_PORT:-6818}
PARTITION=ci
PACKAGES=(slurmd slurmctld slurm-client munge)

log() { echo "$PROG: $*" >&2; }
die() { log "$*"; exit 1; }

usage() {
  echo "usage: $0 up DIR | down DIR" >&2
  exit 2
}

# ---------------------------------------------------------------------------
# Process helpers. Our daemons are recognised by their command line, which
# always names a file under DIR; slurmstepd (whose command line is just
# "slurmstepd: [job.step]") is recognised by the SLURM_CONF it inherited
# from our slurmd. This works even when a pid file was never written.
# ---------------------------------------------------------------------------

# pids of processes named $1 (comm) whose command line mentions $DIR/.
daemon_pids() {
  local name=$1 p
  for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = "$name" ] || continue
    tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "$DIR/" || continue
    alive "${p#/proc/}" && echo "${p#/proc/}"
  done
  return 0
}

# pids of processes named one of "$@" whose environment points SLURM_CONF at
# our config: slurmstepd (it inherits our slurmd's environment) and clients
# such as srun or salloc started by a caller that used `eval "$(... up DIR)"`.
env_pids() {
  local p
  for p in /proc/[0-9]*; do
    case " $* " in *" $(cat "$p/comm" 2>/dev/null) "*) ;; *) continue ;; esac
    tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qxF -- "SLURM_CONF=$DIR/slurm.conf" || continue
    alive "${p#/proc/}" && echo "${p#/proc/}"
  done
  return 0
}

# all descendants of the given pids (not the pids themselves).
descendants() {
  local frontier=" $* " found="" p ppid
  while [ -n "${frontier// /}" ]; do
    local next=" "
    for p in /proc/[0-9]*; do
      # field 4 of /proc/PID/stat is the parent pid; comm (field 2) may hold
      # spaces, so cut after the closing parenthesis.
      ppid=$(sed -e 's/^.*) //' "$p/stat" 2>/dev/null | cut -d' ' -f2)
      [ -n "$ppid" ] || continue
      case $frontier in *" $ppid "*) next+="${p#/proc/} " ;; esac
    done
    found+="$next"
    frontier=$next
  done
  echo $found
}

# pid from a pid file, if that process is alive and has the expected name.
pidfile_pid() {
  local name=$1 file=$2 pid
  [ -s "$file" ] || return 0
  pid=$(tr -dc '0-9' 2>/dev/null <"$file" || true)
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] && alive "$pid" && echo "$pid"
  return 0
}

# true while one of the pids is alive; a zombie (state Z, exited but not yet
# reaped by its parent or by pid 1) counts as dead.
alive() {
  local p
  for p in "$@"; do
    case $(sed -e 's/^.*) //' "/proc/$p/stat" 2>/dev/null | cut -c1) in
      "" | Z) ;;
      *) return 0 ;;
    esac
  done
  return 1
}

# SIGTERM the pids, wait up to $grace seconds, then SIGKILL what is left.
terminate() {
  local what=$1 grace=$2; shift 2
  local pids=$* i
  [ -n "$pids" ] || return 0
  log "stopping $what (pid $pids)"
  kill -TERM $pids 2>/dev/null || true
  for ((i = 0; i < grace * 10; i++)); do
    alive $pids || return 0
    sleep 0.1
  done
  log "$what still alive after ${grace}s; sending SIGKILL"
  kill -KILL $pids 2>/dev/null || true
  for ((i = 0; i < 30; i++)); do
    alive $pids || return 0
    sleep 0.1
  done
  log "warning: $what (pid $pids) survived SIGKILL"
}

# stop daemon $1 found by its pid file $2 and by the /proc scan.
stop_daemon() {
  local name=$1 file=$2 pids
  pids=$( { pidfile_pid "$name" "$file"; daemon_pids "$name"; } | sort -u | tr '\n' ' ')
  terminate "$name" 5 $pids
  rm -f "$file"
}

# ---------------------------------------------------------------------------
# up
# ---------------------------------------------------------------------------

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  # On a systemd host the packages' services stay down: Debian's slurm units
  # need /etc/slurm/slurm.conf, which we never write. A system munged may start;
  # it listens on its own socket and is not used here.
  timeout 600 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 900 \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

start_munge() {
  local sock=$DIR/munge/munge.socket key=$DIR/munge/munge.key
  # munged refuses a socket whose directories are not searchable by everyone
  # ("execute permissions for all required"); mktemp -d makes DIR 0700.
  chmod a+x "$DIR"
  mkdir -p "$DIR/munge"
  chmod 0755 "$DIR/munge"
  if [ ! -s "$key" ]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$key" 2>/dev/null
    else
      dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    fi
  fi
  chmod 0600 "$key"
  if [ -z "$(pidfile_pid munged "$DIR/munge/munged.pid")$(daemon_pids munged)" ]; then
    rm -f "$sock" "$sock.lock"
    timeout 30 munged --socket="$sock" --key-file="$key" \
      --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
      --seed-file="$DIR/munge/munged.seed" ||
      die "munged failed to start; see $DIR/munge/munged.log: $(tail -n 1 "$DIR/munge/munged.log" 2>/dev/null)"
  fi
  timeout 10 munge --socket="$sock" -n 2>/dev/null | timeout 10 unmunge --socket="$sock" >/dev/null 2>&1 ||
    die "munged on $sock does not answer; see $DIR/munge/munged.log"
}

write_config() {
  local node=$1
  # An empty plugstack.conf keeps slurm from reading /etc/slurm/plugstack.conf.
  : >"$DIR/plugstack.conf"
  cat >"$DIR/slurm.conf.new" <<EOF
# One-node CI cluster written by .ci/slurm.sh; everything lives under $DIR.
ClusterName=local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root

# Our own munged, on our own socket.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket

StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/plugstack.conf

# No cgroups, no binding, no MPI, no accounting: plain processes.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MailProg=/bin/true

# Trust the CPU count below rather than the hardware (more slots than cores),
# and put the node back to service by itself after a restart.
SlurmdParameters=config_overrides
ReturnToService=2
# Seconds between SIGTERM and SIGKILL when a job or step is cancelled.
KillWait=5
InactiveLimit=0

NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=$CPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
EOF
  mv -f "$DIR/slurm.conf.new" "$DIR/slurm.conf"
  chmod 0644 "$DIR/slurm.conf" "$DIR/plugstack.conf"
}

# the last error or fatal line in daemon $1's log (for a one-line failure message).
last_error() {
  local f
  case $1 in munged) f=$DIR/munge/munged.log ;; *) f="$DIR/log/$1.log $DIR/log/$1.stderr" ;; esac
  # shellcheck disable=SC2086 # $f holds one or two file names
  cat $f 2>/dev/null | grep -E 'fatal|[Ee]rror' | tail -n 1 | sed -e 's/^\[[^]]*\] //' || true
}

# print the last lines of every log, to stderr, after a failure.
show_logs() {
  local f
  for f in "$DIR"/log/slurmctld.{stderr,log} "$DIR"/log/slurmd.{stderr,log} "$DIR/munge/munged.log"; do
    [ -s "$f" ] || continue
    echo "--- last lines of $f" >&2
    tail -n 15 "$f" >&2
  done
}

cmd_up() {
  local node state deadline d
  node=$(hostname -s)
  install_packages
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
  start_munge
  write_config "$node"
  # Daemons and clients find the config through SLURM_CONF; Debian's default,
  # /etc/slurm/slurm.conf, is never written.
  export SLURM_CONF=$DIR/slurm.conf

  # Both daemons daemonise themselves and write their pid files under DIR/run;
  # what they print before that (e.g. a slurm.conf parse error) goes to
  # DIR/log/NAME.stderr.
  if [ -z "$(daemon_pids slurmctld)" ]; then
    timeout 30 slurmctld -f "$SLURM_CONF" 2>"$DIR/log/slurmctld.stderr" ||
      { show_logs; die "slurmctld failed to start ($(last_error slurmctld)); logs are in $DIR"; }
  fi
  if [ -z "$(daemon_pids slurmd)" ]; then
    timeout 30 slurmd -f "$SLURM_CONF" -N "$node" 2>"$DIR/log/slurmd.stderr" ||
      { show_logs; die "slurmd failed to start ($(last_error slurmd)); logs are in $DIR"; }
  fi

  # Wait (bounded) for the node to be idle, failing early if a daemon died.
  state=""
  deadline=$((SECONDS + WAIT))
  while ((SECONDS < deadline)); do
    state=$(timeout 5 sinfo -h -N -n "$node" -o %T 2>/dev/null || true)
    [ "$state" = idle ] && break
    for d in slurmctld slurmd munged; do
      if [ -z "$(daemon_pids "$d")" ]; then
        show_logs
        die "$d died before node $node became idle ($(last_error "$d")); logs are in $DIR"
      fi
    done
    sleep 1
  done
  if [ "$state" != idle ]; then
    show_logs
    die "node $node not idle after ${WAIT}s (sinfo state: '${state:-no answer}'); logs are in $DIR"
  fi
  log "node $node idle with $CPUS CPUs in partition $PARTITION; run: export SLURM_CONF=$SLURM_CONF"
  # The only line on stdout, for `eval "$(.ci/slurm.sh up DIR)"`.
  echo "export SLURM_CONF=$SLURM_CONF"
}

# ---------------------------------------------------------------------------
# down
# ---------------------------------------------------------------------------

cmd_down() {
  local jobs stepds tree clients left i
  export SLURM_CONF=$DIR/slurm.conf

  # 1. Cancel every job, while slurmctld and slurmd can still clean up.
  if [ -n "$(daemon_pids slurmctld)" ] && command -v squeue >/dev/null; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs $jobs"
      timeout 10 scancel $jobs 2>/dev/null || true
      # KillWait=5: steps get SIGTERM, then SIGKILL five seconds later.
      for ((i = 0; i < 150; i++)); do
        [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null || true)" ] && break
        sleep 0.1
      done
    fi
  fi

  # 2. slurmd, then any step daemon (and its tasks) it left, then slurmctld, then munged.
  stop_daemon slurmd "$DIR/run/slurmd.pid"
  stepds=$(env_pids slurmstepd | tr '\n' ' ')
  if [ -n "${stepds// /}" ]; then
    tree="$stepds $(descendants $stepds)"
    terminate "slurmstepd and its tasks" 3 $tree
  fi
  stop_daemon slurmctld "$DIR/run/slurmctld.pid"
  # Clients still attached to this cluster would only wait for a dead controller.
  clients=$(env_pids srun salloc sbatch | tr '\n' ' ')
  terminate "slurm clients" 3 $clients
  stop_daemon munged "$DIR/munge/munged.pid"
  rm -f "$DIR/munge/munge.socket" "$DIR/munge/munge.socket.lock"

  # 3. Check: nothing of this cluster may be left.
  left="$(daemon_pids slurmctld) $(daemon_pids slurmd) $(daemon_pids munged) $(env_pids slurmstepd)"
  if [ -n "${left//[[:space:]]/}" ]; then
    die "down: processes of $DIR are still alive: $(echo $left)"
  fi
  log "down: no daemon of $DIR left"
}

# ---------------------------------------------------------------------------

[ $# -eq 2 ] || usage
case $1 in up | down) ;; *) usage ;; esac

# The daemons run as root (SlurmUser=root); re-run through sudo if needed.
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "must run as root (no sudo found)"
  exec sudo -n env SLURM_CI_CPUS="$CPUS" SLURM_CI_WAIT="$WAIT" \
    SLURM_CI_CTLD_PORT="$CTLD_PORT" SLURM_CI_SLURMD_PORT="$SLURMD_PORT" \
    bash "$0" "$@"
fi

case $1 in
  up)
    mkdir -p "$2"
    DIR=$(cd "$2" && pwd -P)
    # slurm.conf values cannot hold blanks.
    case $DIR in *[[:space:]]*) die "DIR must not contain whitespace: '$DIR'" ;; esac
    cmd_up
    ;;
  down)
    [ -d "$2" ] || { log "down: $2 does not exist; nothing to stop"; exit 0; }
    DIR=$(cd "$2" && pwd -P)
    cmd_down
    ;;
esac
