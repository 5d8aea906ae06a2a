# keel's binaries in a small image: docker build -t keel .
# keel is the stock binary (ENTRYPOINT): migrate, web, scheduler, relay,
# enqueue, status, dead, ledger, healthcheck, ... for any program's jobs,
# e.g. docker run --rm keel migrate. orders beside it is the example order
# service, built with the cli package as your own worker binary would be;
# docker-compose.yml runs its worker, API, scheduler and dashboard
# (entrypoint: orders).
# Your own image: build your binary the same way and copy it in as well.

FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/ ./cmd/keel ./examples/orders

# distroless/static: CA certificates and time zones, no shell, user nonroot (65532).
# Health checks exec the binary itself: ["CMD", "keel", "healthcheck"].
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/keel /out/orders /usr/local/bin/
USER nonroot:nonroot
EXPOSE 8080
ENTRYPOINT ["keel"]
