#!/bin/sh
# nat-router router   masquerade PRIVATE_SUBNET's traffic to the other networks and
#                     forward this router's private TCP port of FORWARD_TO (host:port)
#                     to it; drop unsolicited inbound traffic (a home router).
# nat-router client   make GATEWAY the default route (a host behind that router).
# Then sleep until stopped.
set -eu

case "${1:-}" in
router)
    : "${PRIVATE_SUBNET:?set PRIVATE_SUBNET, e.g. 10.231.1.0/24}"
    iptables -t nat -A POSTROUTING -s "$PRIVATE_SUBNET" ! -d "$PRIVATE_SUBNET" -j MASQUERADE
    iptables -P FORWARD DROP
    iptables -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    iptables -A FORWARD -s "$PRIVATE_SUBNET" -j ACCEPT
    if [ -n "${FORWARD_TO:-}" ]; then
        name=${FORWARD_TO%:*}
        port=${FORWARD_TO##*:}
        ip=$(getent ahostsv4 "$name" | awk 'NR == 1 { print $1 }')
        [ -n "$ip" ] || { echo "nat-router: cannot resolve $name" >&2; exit 1; }
        own=$(ip -4 -o addr show | awk -v net="${PRIVATE_SUBNET%.*}." 'index($4, net) == 1 { split($4, a, "/"); print a[1] }')
        iptables -t nat -A PREROUTING -d "$own" -p tcp --dport "$port" -j DNAT --to-destination "$ip:$port"
        echo "nat-router: $own:$port -> $FORWARD_TO ($ip)"
    fi
    echo "nat-router: masquerading $PRIVATE_SUBNET"
    ;;
client)
    : "${GATEWAY:?set GATEWAY, the router's private address}"
    ip route replace default via "$GATEWAY"
    echo "nat-router: default route via $GATEWAY"
    ;;
*)
    sed -n '2,7p' "$0" >&2
    exit 2
    ;;
esac
# PID 1 ignores signals it has no handler for: this one lets `docker stop` end it at once.
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
