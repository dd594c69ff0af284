# port_owner.sh: defines `owner PORT UNIT`, who holds the listening socket of a port: "own" (a
# process of the unit's cgroup), "other PID COMM", or "unknown" (no listener found in /proc/net:
# another network namespace). /proc and find only: no ss/lsof needed on a minimal host. Included
# by health_probe.sh (the service role's health wait).
owner() {
  hex=$(printf '%04X' "$1")
  inodes=$(awk -v p=":$hex" 'FNR > 1 && $4 == "0A" && substr($2, length($2) - 4) == p {print $10}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
  [ -n "$inodes" ] || { echo unknown; return; }
  cg=$(systemctl show -p ControlGroup --value "$2" 2>/dev/null)
  for i in $inodes; do
    for f in $(find /proc/[0-9]*/fd -maxdepth 1 -lname "socket:\[$i\]" 2>/dev/null | head -3); do
      pid=${f#/proc/}; pid=${pid%%/*}
      if [ -n "$cg" ] && grep -q ":$cg\$" /proc/$pid/cgroup 2>/dev/null; then echo own; return; fi
      echo "other $pid $(cat /proc/$pid/comm 2>/dev/null)"; return
    done
  done
  echo unknown
}
