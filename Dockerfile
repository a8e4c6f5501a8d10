# The idem image: a static binary on distroless, running as non-root.
#
#   docker build -t ghcr.io/idem-dev/idem:latest .
#   docker run -p 8080:8080 -p 8081:8081 -v idem-data:/var/lib/idem ghcr.io/idem-dev/idem:latest
#
# Outside Kubernetes the image serves on every interface of the container
# (8080 the edge, 8081 /livez, /readyz, /metrics) with its embedded etcd's
# data in /var/lib/idem, a volume owned by the image's user; every default
# is an IDEM_* variable, so `-e IDEM_UPSTREAM=http://app:9000` and the like
# configure it, and deploy/'s manifests override them.
#
# The binary is built with CGO_ENABLED=0 (statically linked, no libc), so the
# distroless "static" base, which has no shell and no package manager, is
# enough. deploy/ runs it with a read-only root filesystem as user 65532.
# Go 1.27.3: the release with no known standard-library vulnerabilities
# (docs/SECURITY.md; scripts/govulncheck.sh checks it).
FROM golang:1.27.3 AS build
WORKDIR /src
# The root module alone: the workspace's other modules (tests, deploy,
# benchmarks) are not part of the binary.
ENV GOWORK=off
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/idem ./cmd/idem && mkdir -p -m 0700 /out/data

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idem /idem
COPY --from=build --chown=65532:65532 /out/data /var/lib/idem
USER 65532:65532
ENV IDEM_LISTEN=0.0.0.0:8080 \
    IDEM_ADMIN_LISTEN=0.0.0.0:8081 \
    IDEM_DATA_DIR=/var/lib/idem
VOLUME /var/lib/idem
EXPOSE 8080 8081
ENTRYPOINT ["/idem"]
CMD ["serve"]
