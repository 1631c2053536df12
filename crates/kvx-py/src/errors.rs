//! The exceptions a Python caller catches, one per thing it can act on, all under
//! `kvx.KvxError`; each carries the message of the Rust error it stands for.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    kvx,
    KvxError,
    PyException,
    "Base class of every error kvx raises."
);
create_exception!(
    kvx,
    RefusedError,
    KvxError,
    "The receiver or the proxy refused the request (its reason is the message)."
);
create_exception!(
    kvx,
    IdentityRefusedError,
    RefusedError,
    "The receiver refused this sender's identity: another of its connections holds it (two \
     senders given the same local_id), or it breaks ZeroMQ's rules (1 to 255 bytes, no \
     leading zero byte). Give each sender its own local_id, or leave it to kvx."
);
create_exception!(
    kvx,
    TimedOutError,
    KvxError,
    "A bounded wait ran out (staging, admission, an outcome)."
);
create_exception!(kvx, CancelledError, KvxError, "The request was cancelled.");
create_exception!(
    kvx,
    ReceiverLostError,
    KvxError,
    "The connection to the receiver (or the proxy) was lost, or it has stopped."
);
create_exception!(
    kvx,
    StoppedError,
    KvxError,
    "This sender or receiver has stopped: its driver ended (shutdown, close, or the process's \
     kvx runtime went away), so no call on it can succeed. Make a new one."
);
create_exception!(
    kvx,
    MisuseError,
    KvxError,
    "A call broke the API's contract (an unknown request, more chunks than declared, …)."
);
create_exception!(
    kvx,
    StartError,
    KvxError,
    "A kvx object could not start (a port in use, an invalid setting, no device)."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvxError", py.get_type::<KvxError>())?;
    m.add("RefusedError", py.get_type::<RefusedError>())?;
    m.add(
        "IdentityRefusedError",
        py.get_type::<IdentityRefusedError>(),
    )?;
    m.add("TimedOutError", py.get_type::<TimedOutError>())?;
    m.add("CancelledError", py.get_type::<CancelledError>())?;
    m.add("ReceiverLostError", py.get_type::<ReceiverLostError>())?;
    m.add("StoppedError", py.get_type::<StoppedError>())?;
    m.add("MisuseError", py.get_type::<MisuseError>())?;
    m.add("StartError", py.get_type::<StartError>())?;
    Ok(())
}

/// A failure to start, as `StartError`.
pub(crate) fn start(e: impl std::fmt::Display) -> PyErr {
    StartError::new_err(e.to_string())
}

/// A proxy's failure of an awaited request.
pub(crate) fn proxy_failure(f: &kvx_proto::proxy::ProxyFailure) -> PyErr {
    use kvx_proto::proxy::ProxyFailure as F;
    match f {
        F::Reported(_) => RefusedError::new_err(f.to_string()),
        F::TimedOut { .. } => TimedOutError::new_err(f.to_string()),
        // The proxy's own driver has ended: its error, never a request's.
        F::ProxyGone => StoppedError::new_err(f.to_string()),
        _ => KvxError::new_err(f.to_string()),
    }
}

/// Why the proxy would not await a request.
pub(crate) fn expect_error(e: &kvx_proto::proxy::ExpectError) -> PyErr {
    use kvx_proto::proxy::ExpectError as E;
    match e {
        E::ProxyGone => StoppedError::new_err(e.to_string()),
        E::TooMany(_) => RefusedError::new_err(e.to_string()),
        _ => MisuseError::new_err(e.to_string()),
    }
}

/// Why a request failed, as the exception a caller acts on.
pub(crate) fn send_failure(f: &kvx_proto::sender::SendFailure) -> PyErr {
    failure_with(f, f.to_string())
}

/// The exception for failure `f`, saying `msg`.
fn failure_with(f: &kvx_proto::sender::SendFailure, msg: String) -> PyErr {
    use kvx_proto::sender::SendFailure as F;
    match f {
        F::Cancelled => CancelledError::new_err(msg),
        F::Refused(_) => RefusedError::new_err(msg),
        F::ReplyTimeout | F::WriteTimeout => TimedOutError::new_err(msg),
        F::ChannelLost | F::WriteFailed(_) => ReceiverLostError::new_err(msg),
        F::Misuse(_) => MisuseError::new_err(msg),
        F::Stopped => StoppedError::new_err(msg),
        _ => KvxError::new_err(msg),
    }
}

/// Why a sender call was refused, as the exception a caller acts on.
pub(crate) fn send_error(e: &kvx_proto::sender::SendError) -> PyErr {
    use kvx_proto::sender::SendError as E;
    let msg = e.to_string();
    match e {
        E::Failed(_, f) => failure_with(f, msg),
        E::WouldBlock | E::StagingTimedOut(_) => TimedOutError::new_err(msg),
        E::TooManyRequests(_) | E::ChannelFull(..) => RefusedError::new_err(msg),
        _ => MisuseError::new_err(msg),
    }
}

/// A kvx-embed error.
pub(crate) fn embed(e: &kvx_embed::EmbedError) -> PyErr {
    use kvx_embed::EmbedError as E;
    let msg = e.to_string();
    if e.is_refused() {
        // A CURVE refusal (no key, a key off the allow-list, the wrong server key) is no
        // identity's: every CURVE reason begins "CURVE:" (kvx_transport's, sent or heard).
        if msg.contains("CURVE:") {
            return RefusedError::new_err(msg);
        }
        return IdentityRefusedError::new_err(msg);
    }
    if e.is_stopped() {
        return StoppedError::new_err(msg);
    }
    match e {
        E::TimedOut(_) => TimedOutError::new_err(msg),
        E::Consume(_) => ReceiverLostError::new_err(msg),
        // A reservation refused for its content or for this receiver's placement.
        E::Placement(_) => MisuseError::new_err(msg),
        _ => StartError::new_err(msg),
    }
}
