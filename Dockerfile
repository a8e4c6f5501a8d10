# The idem image: a static binary on distroless, running as non-root.
#
#   docker build -t ghcr.io/idem-dev/idem:latest .
#
# The binary is built with CGO_ENABLED=0 (statically linked, no libc), so the
# distroless "static" base, which has no shell and no package manager, is
# enough. deploy/ runs it with a read-only root filesystem as user 65532.
# Go 1.27.3: the release with no known standard-library vulnerabilities
# (docs/SECURITY.md; scripts/govulncheck.sh checks it).
FROM golang:1.27.3 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/idem ./cmd/idem

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idem /idem
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/idem"]
CMD ["serve"]
