//! Zero-copy sends for `TcpFabric` on Linux: a payload goes from its staging slot into a pipe
//! with `vmsplice` (the pipe references the staging pages; nothing is copied) and from the
//! pipe into the socket with `splice` (the socket's buffers reference the same pages). Over
//! loopback the receiver's `recv` is then the only copy of the bytes instead of two, and a NIC
//! reads the pages directly. `docs/spec/fabrics.md` §Zero-copy sends has the measurements.
//!
//! The rule that makes this correct: the kernel reads the staging pages until the receiver has
//! read the bytes, so a staging slot must not be rewritten before then. It holds in kvx by
//! construction: `TcpFabric` completes a write only on the receiver's ack, which it sends
//! after the bytes are in its memory, and the sender core reuses a staging slot only after its
//! write completed, or was flushed, and a flush happens only after the connection was aborted
//! and the receiver fenced (nothing read from it after that lands). Page lifetimes are the
//! kernel's concern: it holds a reference to every page it still needs, so freeing the staging
//! memory early is not a memory-safety problem either.
//!
//! `unsafe` is confined to this file: three libc calls on file descriptors this type owns.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::Interest;
use tokio::net::TcpStream;

/// The pipe's capacity asked for: one 1 MiB chunk in flight between the two calls. The
/// kernel may grant less (`/proc/sys/fs/pipe-max-size`); the code only relies on `EAGAIN`.
const PIPE_BYTES: libc::c_int = 1 << 20;

/// A pipe between staging memory and one socket.
#[derive(Debug)]
pub(crate) struct SplicePipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Bytes in the pipe, not yet in the socket.
    queued: usize,
}

fn check(ret: isize) -> io::Result<usize> {
    usize::try_from(ret).map_err(|_| io::Error::last_os_error())
}

impl SplicePipe {
    /// A non-blocking pipe, enlarged when the kernel allows.
    pub(crate) fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a writable array of two ints, as pipe2 requires.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A smaller pipe only costs more calls, so a refusal is not an error.
        // SAFETY: fcntl on a descriptor this function owns; no pointers.
        let _ = unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES) };
        Ok(Self {
            read,
            write,
            queued: 0,
        })
    }

    /// Bytes in the pipe that still have to go to the socket.
    pub(crate) fn queued(&self) -> usize {
        self.queued
    }

    /// Copies `bytes` into the pipe (for small headers, which live on the stack and so must
    /// not be referenced). Returns how many it took; `WouldBlock` when the pipe is full.
    pub(crate) fn copy_in(&mut self, bytes: &[u8]) -> io::Result<usize> {
        // SAFETY: the pointer and length describe `bytes`, valid for reads for the call.
        let n = check(unsafe {
            libc::write(self.write.as_raw_fd(), bytes.as_ptr().cast(), bytes.len())
        })?;
        self.queued += n;
        Ok(n)
    }

    /// Maps `bytes` into the pipe without copying. The kernel reads them later, until the
    /// receiver has read them: the caller must not change them before the write completes
    /// (see the module comment for why kvx never does). Returns how many bytes it took;
    /// `WouldBlock` when the pipe is full.
    pub(crate) fn map_in(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let iov = libc::iovec {
            iov_base: bytes.as_ptr().cast_mut().cast(),
            iov_len: bytes.len(),
        };
        // SAFETY: one iovec describing `bytes`, valid for the call; vmsplice without
        // SPLICE_F_GIFT only reads the pages (and pins them while the pipe needs them).
        let n = check(unsafe {
            libc::vmsplice(self.write.as_raw_fd(), &iov, 1, libc::SPLICE_F_NONBLOCK)
        })?;
        self.queued += n;
        Ok(n)
    }

    /// Moves as much of the pipe into `stream` as its send buffer takes; `WouldBlock` (and
    /// tokio's readiness cleared) when it takes nothing.
    pub(crate) fn drain_into(&mut self, stream: &TcpStream) -> io::Result<usize> {
        let (pipe, socket, len) = (self.read.as_raw_fd(), stream.as_raw_fd(), self.queued);
        let n = stream.try_io(Interest::WRITABLE, || {
            // SAFETY: two descriptors that stay open for the call (the pipe is ours, the
            // socket is borrowed); null offsets, as pipes and sockets require.
            check(unsafe {
                libc::splice(
                    pipe,
                    std::ptr::null_mut(),
                    socket,
                    std::ptr::null_mut(),
                    len,
                    libc::SPLICE_F_NONBLOCK | libc::SPLICE_F_MOVE,
                )
            })
        })?;
        self.queued -= n;
        Ok(n)
    }
}
