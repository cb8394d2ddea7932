#!/usr/bin/env bash
# The tests' two-node Slurm on this machine (Debian's Slurm 22.05 and munge; root).
#   tests/slurm/cluster.sh install   apt-get install slurmctld slurmd slurm-client munge, if missing
#   tests/slurm/cluster.sh start     munged, slurmctld and `slurmd -N n1`, `slurmd -N n2`; waits until both idle
#   tests/slurm/cluster.sh stop      stops what start started
#   tests/slurm/cluster.sh env       the SLURM_CONF line to export for srun, squeue, sacct ...
# State, logs and the written slurm.conf live in $LORA_SLURM_STATE (default /tmp/lora-pipeline-slurm).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
STATE="${LORA_SLURM_STATE:-/tmp/lora-pipeline-slurm}"
CONF="$STATE/slurm.conf"
PACKAGES=(slurmctld slurmd slurm-client munge)

installed() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
              && command -v munged >/dev/null; }

install() {
  installed && return 0
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
  # The packages' own services are not used: this script runs the daemons with its own config.
}

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && munge -n >/dev/null 2>&1; then return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null || \
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge   # munged refuses a socket folder it does not own
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  touch "$STATE/munged.started"  # stop ends only a munged that start started
}

start() {
  installed || { echo "Slurm is not installed: $0 install" >&2; exit 1; }
  mkdir -p "$STATE/ctld" "$STATE/spool"
  export LORA_SLURM_STATE="$STATE"
  sed -e "s|@STATE@|$STATE|g" -e "s|@CTLD_PORT@|${LORA_SLURM_PORT:-16817}|" \
      -e "s|@PORT1@|$(( ${LORA_SLURM_PORT:-16817} + 1 ))|" -e "s|@PORT2@|$(( ${LORA_SLURM_PORT:-16817} + 2 ))|" \
      "$HERE/slurm.conf.in" > "$CONF"
  export SLURM_CONF="$CONF"
  start_munge
  pid_alive "$STATE/slurmctld.pid" || slurmctld -f "$CONF" -i
  for node in n1 n2; do
    pid_alive "$STATE/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node"
  done
  for _ in $(seq 60); do  # both nodes idle: ready for jobs
    [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | grep -c ' idle$')" = 2 ] && return 0
    sleep 1
  done
  echo "the test cluster did not come up; sinfo:" >&2
  sinfo -N >&2 || true
  tail -n 20 "$STATE"/*.log >&2 || true
  exit 1
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {
  export SLURM_CONF="$CONF"
  [ -f "$CONF" ] && scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
  for pidfile in "$STATE"/slurmd-n1.pid "$STATE"/slurmd-n2.pid "$STATE"/slurmctld.pid; do
    if pid_alive "$pidfile"; then
      pid=$(cat "$pidfile"); kill "$pid"
      for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
  done
  if [ -f "$STATE/munged.started" ] && pid_alive /run/munge/munged.pid; then
    kill "$(cat /run/munge/munged.pid)"; rm -f "$STATE/munged.started"
  fi
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  env) echo "SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install|start|stop|env" >&2; exit 2 ;;
esac
