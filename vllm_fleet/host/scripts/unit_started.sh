# unit_started.sh: when a unit's main process started and the open-files limit it got, for the
# service role's "start to healthy" line. Run as root:
#     sh -c "$(cat unit_started.sh)" unit-started UNIT
# Prints the start (ExecMainStartTimestamp, wall clock, seconds since the epoch), the host's clock
# now (the same), and the main process's "Max open files" soft limit (a line each; empty when unknown).
t=$(systemctl show -p ExecMainStartTimestamp --value --timestamp=us+utc "$1") && date -u -d "$t" +%s.%N && date -u +%s.%N
awk '/^Max open files/ {print $4}' /proc/$(systemctl show -p MainPID --value "$1")/limits 2>/dev/null
