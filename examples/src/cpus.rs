//! Splitting the machine's CPUs between a benchmark and the systems it measures: the benchmark
//! (load generator and in-process mock engines) on one CPU, every process it starts on the
//! others. On a small machine the systems then each get the same dedicated CPUs instead of
//! sharing them with the load they are sent, so their throughputs compare the systems, not how
//! much room the load generator left them.

use std::sync::OnceLock;

/// The CPUs every process started from now on runs on (set once by [`split`]).
static CHILD_CPUS: OnceLock<libc::cpu_set_t> = OnceLock::new();

/// Which CPUs went where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// The calling process's CPU.
    pub own: usize,
    /// The CPUs of the processes it starts.
    pub children: Vec<usize>,
}

/// Pins the calling thread (and so every thread it starts later, such as an async runtime's
/// workers) to the first CPU it may run on, and every process started afterwards through
/// [`crate::process`] to the others. Call it before any other thread starts.
pub fn split() -> Result<Split, String> {
    let allowed = allowed_cpus()?;
    let [own, children @ ..] = allowed.as_slice() else {
        return Err("no CPU is allowed".to_owned());
    };
    if children.is_empty() {
        return Err(format!(
            "only CPU {own} is allowed: splitting needs at least two"
        ));
    }
    set_affinity(&cpu_set(&[*own])).map_err(|err| format!("sched_setaffinity: {err}"))?;
    // A second split keeps the first one's children: the calling thread is then on one CPU.
    let _ = CHILD_CPUS.set(cpu_set(children));
    Ok(Split {
        own: *own,
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
