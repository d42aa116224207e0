//! Splitting the machine's CPUs between a benchmark and the systems it measures: every process
//! the benchmark starts on the last N CPUs it may use, the benchmark itself (load generator and
//! in-process mock engines) on the others. The systems then each get the same dedicated CPUs
//! instead of sharing them with the load they are sent, so their throughputs compare the
//! systems per core, not how much room the load generator left them.

use std::sync::OnceLock;

/// The CPUs every process started from now on runs on (set once by [`split`]).
static CHILD_CPUS: OnceLock<libc::cpu_set_t> = OnceLock::new();

/// Which CPUs went where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// The calling process's CPUs.
    pub own: Vec<usize>,
    /// The CPUs of the processes it starts.
    pub children: Vec<usize>,
}

/// Pins every process started from now on through [`crate::process`] to the last `children`
/// CPUs the caller may run on, and the calling thread (and so every thread it starts later,
/// such as an async runtime's workers) to the others; `None` leaves the caller one CPU. Call it
/// before any other thread starts.
pub fn split(children: Option<usize>) -> Result<Split, String> {
    let allowed = allowed_cpus()?;
    let children = children.unwrap_or(allowed.len().saturating_sub(1));
    if children == 0 || children >= allowed.len() {
        return Err(format!(
            "{children} CPUs for the systems under test out of the {} allowed ({allowed:?}): \
             the benchmark needs one or more of its own, and they at least one",
            allowed.len()
        ));
    }
    let (own, children) = allowed.split_at(allowed.len() - children);
    set_affinity(&cpu_set(own)).map_err(|err| format!("sched_setaffinity: {err}"))?;
    // A second split keeps the first one's children.
    let _ = CHILD_CPUS.set(cpu_set(children));
    Ok(Split {
        own: own.to_vec(),
        children: children.to_vec(),
    })
}

/// The CPUs processes started now must run on, when [`split`] was called.
pub(crate) fn child_cpus() -> Option<&'static libc::cpu_set_t> {
    CHILD_CPUS.get()
}

/// Applies `cpus` to the calling thread. Only calls sched_setaffinity(2) and allocates
/// nothing, so it may run in a child between fork and exec.
pub(crate) fn set_affinity(cpus: &libc::cpu_set_t) -> std::io::Result<()> {
    // SAFETY: `cpus` is a valid, initialised cpu_set_t of the size passed.
    let status = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(cpus), cpus) };
    if status == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn allowed_cpus() -> Result<Vec<usize>, String> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set, filled by sched_getaffinity(2).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let status = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if status != 0 {
        return Err(format!(
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: CPU_ISSET reads a bit of a valid set, for an index below its capacity.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: CPU_SET writes a bit of a valid set; the indices come from the allowed set.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_set_holds_exactly_the_cpus_put_in_it() {
        let set = cpu_set(&[0, 3, 5]);
        let held: Vec<usize> = (0..8)
            .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
            .collect();
        assert_eq!(held, vec![0, 3, 5]);
    }
}
