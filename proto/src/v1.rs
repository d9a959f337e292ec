//! Generated code for `rankscope.v1` (`proto/rankscope/v1/telemetry.proto`).

tonic::include_proto!("rankscope.v1");
