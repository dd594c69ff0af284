# health_probe.sh: one look at a vLLM instance for the service role's health wait. Run as root:
#     sh -c "$(cat health_probe.sh)" health-probe URL UNIT [PORT]
# Prints four lines: the HTTP code of URL (empty: no answer), the unit's ActiveState, its
# NRestarts, and who listens on PORT (port_owner.sh) when the code is 200 and PORT is given
# (else an empty line).
# vllm-fleet: include port_owner.sh
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$1"); echo "$code"
systemctl is-active "$2" || true
systemctl show -p NRestarts --value "$2"
if [ -n "$3" ] && [ "$code" = 200 ]; then owner "$3" "$2"; else echo; fi
