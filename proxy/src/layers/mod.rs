//! The layers in front of the proxied routes, outermost first: [`request_id`] (every answer
//! carries the request's `X-Request-Id`), [`track`] (the request is counted from arrival to
//! the end of its streamed answer), [`auth`] (the `--api-key` check); and in front of the
//! whole serving port, [`operator`] (the admin key on every route that is not a client's or a
//! probe's).

pub(crate) mod auth;
pub(crate) mod operator;
pub(crate) mod request_id;
pub(crate) mod track;
