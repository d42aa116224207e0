//! Client library for the pd-bootstrap server: wire types and helpers shared by every binary.

pub mod protocol;
pub mod service;
