# The NAT router of docker/compose.yaml's `nat` profile (and its private-side
# helper): Debian with iptables and iproute2. Built from docker/.
FROM python:3.11-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables iproute2 \
    && rm -rf /var/lib/apt/lists/*
COPY nat-router.sh /usr/local/bin/nat-router
RUN chmod 0755 /usr/local/bin/nat-router
ENTRYPOINT ["nat-router"]
