//! UCX status codes as a Rust error: which call failed and the status's name.

use std::ffi::CStr;

use ucx_sys::{ucs_status_ptr_t, ucs_status_string, ucs_status_t, UCS_OK};

/// A UCX call that returned an error status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} (UCX status {status})")]
pub struct UcxError {
    /// The UCX function.
    pub call: &'static str,
    /// The `ucs_status_t` value.
    pub status: i8,
    /// What `ucs_status_string` calls it.
    pub name: String,
}

impl UcxError {
    /// The error for `status` returned by `call`.
    pub fn new(call: &'static str, status: ucs_status_t) -> Self {
        // SAFETY: ucs_status_string returns a pointer to a static C string for any value.
        let name = unsafe { CStr::from_ptr(ucs_status_string(status)) }
            .to_string_lossy()
            .into_owned();
        UcxError { call, status, name }
    }
}

/// `Ok` for `UCS_OK`, the error otherwise.
pub(crate) fn check(call: &'static str, status: ucs_status_t) -> Result<(), UcxError> {
    if status == UCS_OK {
        Ok(())
    } else {
        Err(UcxError::new(call, status))
    }
}

/// What a call returning `ucs_status_ptr_t` gave back.
pub(crate) enum StatusPtr {
    /// Completed at once.
    Done,
    /// A request to poll and free.
    Request(ucs_status_ptr_t),
}

/// Decodes a status pointer: done, a request, or an error.
pub(crate) fn check_ptr(call: &'static str, ptr: ucs_status_ptr_t) -> Result<StatusPtr, UcxError> {
    if ucx_sys::UCS_PTR_IS_PTR(ptr) {
        Ok(StatusPtr::Request(ptr))
    } else {
        check(call, ucx_sys::UCS_PTR_STATUS(ptr)).map(|()| StatusPtr::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_carry_their_names() {
        assert_eq!(check("ucp_x", UCS_OK), Ok(()));
        let err = check("ucp_x", ucx_sys::UCS_ERR_UNREACHABLE).unwrap_err();
        assert_eq!(
            err.to_string(),
            "ucp_x failed: Destination is unreachable (UCX status -6)"
        );
        let ptr = ucx_sys::UCS_ERR_CANCELED as isize as ucs_status_ptr_t;
        assert_eq!(
            check_ptr("ucp_y", ptr).err().map(|e| e.status),
            Some(ucx_sys::UCS_ERR_CANCELED)
        );
        assert!(matches!(
            check_ptr("ucp_y", std::ptr::null_mut()),
            Ok(StatusPtr::Done)
        ));
    }
}
