# keel's one binary in a small image: docker build -t keel .
# The image runs as a non-root user; its subcommands are keel's own
# (worker, scheduler, web, migrate, ...), e.g. docker run --rm keel migrate.

FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/keel ./cmd/keel

# distroless/static: CA certificates and time zones, no shell, user nonroot (65532).
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/keel /usr/local/bin/keel
USER nonroot:nonroot
EXPOSE 8080
ENTRYPOINT ["keel"]
