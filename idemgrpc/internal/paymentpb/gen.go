// Package paymentpb is a small payments API for idemgrpc's tests and
// examples.
package paymentpb

//go:generate protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative payment.proto
