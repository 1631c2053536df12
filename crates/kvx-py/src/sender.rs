//! `kvx.Sender` and `kvx.StagingSlot`: a prefill worker's side, over `kvx_embed::Sender`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kvx_embed::{SenderSettings, StagingGuard};
use kvx_io::SlotMemory;
use kvx_node::ReceiverAddr;
use kvx_proto::sender::{RequestSpec, SendError};
use kvx_proto::{PeerId, Placement, ReqId, SenderConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::{aio, env, errors, memory, placement, runtime, wait};

/// How long leaving a ``with`` block waits for the notices already due to the proxy.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// A sender: moves a prefill's KV chunks from its staging into receivers' buffers.
///
/// ``Sender(*, slots, slot_bytes, staging=None, transport="zmq", fabric="tcp", proxy=None,
/// local_id=None, staging_timeout=None, reply_timeout=None, write_timeout=None,
/// checksums=None, failure_notices=None, curve_secret_key=None, curve_server_key=None,
/// placement="pool")``
///
/// A protocol setting given as ``None`` is kvx's default, the one ``kvx sender`` runs with
/// (``kvx.defaults()["sender"]``: 30 s staging timeout, 10 s reply and write timeouts,
/// checksums on, failure notices on; ``failure_notices`` is ``notify_proxy_on_failure``).
///
/// ``staging`` is the memory chunks are staged in: a writable, contiguous buffer of
/// ``slots × slot_bytes`` bytes (``bytearray``, NumPy array, CPU ``torch.Tensor``) that the
/// sender keeps alive; ``None``: a fresh ``bytearray``. The ``shm`` fabric allocates a shared
/// mapping of its own instead (pass no ``staging``): ``Sender.staging`` and the slot views
/// are views of that mapping, which they keep alive.
/// Write a staging slot only while you hold it (between ``allocate`` and ``add``).
/// ``failure_notices``: a failed request is reported to the proxy (kvx's ``FailNotif``);
/// off for a proxy that knows only LMCache's messages.
/// ``local_id``: this sender's identity on every receiver; ``None``: one of its own, unique
/// per ``Sender`` (several in one process too). Two senders given the same one cannot use
/// the same receiver at once: the second's ``add_receiver`` raises ``IdentityRefusedError``.
/// ``curve_secret_key``, ``curve_server_key``: CURVE on the alloc and notice channels (both
/// or neither): this sender's secret certificate (``NAME.key_secret``), whose public half is
/// on the receivers' and proxy's allow-lists, and the public certificate (``NAME.key``) of the
/// receivers and proxy, which share that key pair (``docs/operations.md``, "CURVE").
///
/// A request: ``begin`` → ``wait_admitted`` → per chunk ``allocate`` a slot, write it,
/// ``add`` it → ``submit`` batches (the last with ``last=True``) → ``wait_outcome`` or
/// ``next_ends``.
///
/// ``placement="caller"`` (docs/spec/protocol.md, "Caller staging"): ``staging`` is the
/// program's own memory where the chunks already are (a prefill engine's per-layer KV
/// tensors: a list of buffers of the same size, each holding ``slots / len(staging)``
/// slots, slot ``p * (slots // len(staging)) + i`` being slot i of part p); nothing is
/// allocated or copied: ``submit_slots`` names the slots each batch is read from, and
/// ``wait_released`` says when the program may change them again.
#[pyclass(module = "kvx", frozen)]
pub(crate) struct Sender {
    inner: kvx_embed::Sender,
    /// The staging's byte view, when the memory is Python's.
    view: Option<Py<PyAny>>,
}

/// A staging slot held for one request, from ``Sender.allocate``: write the chunk into
/// ``view`` (or with ``write``), then ``Sender.add`` it. Dropped (or ``release``d) before
/// that, the slot goes back to the pool.
#[pyclass(module = "kvx", frozen)]
pub(crate) struct StagingSlot {
    guard: Mutex<Option<StagingGuard>>,
    index: u32,
    req_id: String,
    view: Option<Py<PyAny>>,
}

#[pymethods]
impl Sender {
    #[new]
    #[pyo3(signature = (*, slots, slot_bytes, staging = None, transport = "zmq", fabric = "tcp",
        proxy = None, local_id = None, staging_timeout = None, reply_timeout = None,
        write_timeout = None, checksums = None, failure_notices = None, curve_secret_key = None,
        curve_server_key = None, placement = "pool", heartbeat_interval = None, heartbeat_timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        slots: u32,
        slot_bytes: usize,
        staging: Option<&Bound<'_, PyAny>>,
        transport: &str,
        fabric: &str,
        proxy: Option<String>,
        local_id: Option<String>,
        staging_timeout: Option<f64>,
        reply_timeout: Option<f64>,
        write_timeout: Option<f64>,
        checksums: Option<bool>,
        failure_notices: Option<bool>,
        curve_secret_key: Option<PathBuf>,
        curve_server_key: Option<PathBuf>,
        placement: &str,
        heartbeat_interval: Option<f64>,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let staging_placement = placement::named(placement)?;
        let curve = env::curve_client(curve_secret_key, curve_server_key)?;
        let heartbeats = env::Heartbeats {
            interval: heartbeat_interval,
            timeout: heartbeat_timeout,
        };
        let choice = env::choice(transport, fabric, curve, heartbeats)?;
        let own = env::needs_own_mapping(&choice);
        if staging_placement == Placement::Caller && (staging.is_none() || own) {
            return Err(PyValueError::new_err(
                "placement=\"caller\" sends from the program's own memory: pass it as staging \
                 (one buffer, or a list of per-layer buffers), on a fabric that takes it (tcp)",
            ));
        }
        let in_parts = match staging {
            Some(s) if s.is_instance_of::<PyList>() || s.is_instance_of::<PyTuple>() => {
                if own {
                    return Err(PyValueError::new_err(
                        "the shm fabric allocates its own staging: it cannot take one in parts",
                    ));
                }
                Some(memory::lend_parts(py, s, slots, slot_bytes)?.0)
            }
            _ => None,
        };
        let (memory, view) = match in_parts {
            // Each part is the caller's own object: there is no one view of them all.
            Some(memory) => (memory, None),
            None => memory::choose(py, staging, slots, slot_bytes, own)?,
        };
        let core = SenderConfig::default();
        let given = |s: Option<f64>, what, default| match s {
            Some(s) => wait::positive_seconds(s, what),
            None => Ok(default),
        };
        let config = SenderConfig {
            staging_slots: slots,
            staging_timeout: given(staging_timeout, "staging_timeout", core.staging_timeout)?,
            reply_timeout: given(reply_timeout, "reply_timeout", core.reply_timeout)?,
            write_timeout: given(write_timeout, "write_timeout", core.write_timeout)?,
            checksums: checksums.unwrap_or(core.checksums),
            notify_proxy_on_failure: failure_notices.unwrap_or(core.notify_proxy_on_failure),
            staging_placement,
            ..core
        };
        // Checked here, once: kvx's driver and core take it as it is.
        let config = config
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let local_id = match local_id {
            Some(id) => id,
            // One of its own per sender, several in one process too (a receiver refuses a
            // second connection under an identity another holds).
            None => kvx_embed::unique_local_id("kvx-py").map_err(|e| errors::embed(&e))?,
        };
        let settings = SenderSettings {
            env: choice,
            config,
            staging: memory,
            local_id,
            proxy,
        };
        let rt = runtime::get()?;
        let inner = py
            .detach(|| kvx_embed::Sender::start(rt, settings))
            .map_err(|e| errors::embed(&e))?;
        let view = memory::view_once_started(py, view, || inner.memory_view())?;
        Ok(Self { inner, view })
    }

    /// Connects to a receiver (its alloc and fabric endpoints, as ``Receiver`` reports
    /// them) and returns its id for ``begin``. Once per address; later calls return the same.
    /// Raises ``IdentityRefusedError`` when the receiver refuses this sender's identity
    /// (another sender's connection holds it: two senders given the same ``local_id``).
    #[pyo3(signature = (alloc, fabric, *, timeout = 10.0))]
    fn add_receiver(
        &self,
        py: Python<'_>,
        alloc: String,
        fabric: String,
        timeout: f64,
    ) -> PyResult<u64> {
        let timeout = wait::positive_seconds(timeout, "timeout")?;
        let addr = ReceiverAddr { alloc, fabric };
        let peer = py
            .detach(|| self.inner.add_receiver(addr, timeout))
            .map_err(|e| errors::embed(&e))?;
        Ok(peer.0)
    }

    /// Begins request ``req_id`` of ``total_chunks`` chunks to receiver ``receiver`` (an id
    /// from ``add_receiver``); its admission probe goes out at once. ``shape``, ``dtype`` and
    /// ``fmt`` describe the KV layout to the receiver (LMCache's fields). ``claim_secret``:
    /// the secret of the receiver's reservation for this request (``Receiver.reserve``),
    /// which a receiver with ``placement="caller"`` requires; sent with the request's first
    /// message only, never printed. ``report_admission``: its admission (or why it never
    /// came) is reported once through ``next_admitted``, instead of asked for.
    #[pyo3(signature = (req_id, *, receiver, total_chunks, shape = vec![1], dtype = "bfloat16".to_owned(), fmt = 1, claim_secret = None, report_admission = false))]
    #[allow(clippy::too_many_arguments)] // Python keywords, each with its default
    fn begin(
        &self,
        req_id: String,
        receiver: u64,
        total_chunks: u32,
        shape: Vec<u64>,
        dtype: String,
        fmt: u32,
        claim_secret: Option<String>,
        report_admission: bool,
    ) -> PyResult<()> {
        let claim = claim_secret
            .map(crate::placement::claim_secret)
            .transpose()?;
        let spec = RequestSpec {
            req_id: ReqId(req_id),
            receiver: PeerId(receiver),
            total_chunks,
            fmt,
            shape,
            dtype,
            claim,
        };
        if report_admission {
            self.inner.begin_reporting_admission(spec)
        } else {
            self.inner.handle().begin(spec)
        }
        .map_err(|e| errors::send_error(&e))
    }

    /// Up to ``max`` admissions of requests begun with ``report_admission=True``, as
    /// ``(req_id, error)`` pairs (``error`` None: admitted; else the exception saying why it
    /// never will be), waiting at most ``timeout`` for the first; ``[]`` when none came. Each
    /// comes once, to one caller.
    #[pyo3(signature = (max = 64, timeout = None))]
    fn next_admitted(
        &self,
        py: Python<'_>,
        max: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<(String, Option<PyErr>)>> {
        let admissions =
            wait::interruptibly(py, wait::seconds(timeout)?, self.inner.admissions(max))?
                .unwrap_or_default();
        Ok(admissions
            .into_iter()
            .map(|a| {
                (
                    a.req_id.0,
                    a.outcome.err().map(|f| errors::send_failure(&f)),
                )
            })
            .collect())
    }

    /// Waits until the receiver admitted ``req_id`` (reserved room for all its chunks).
    /// True once admitted; False when ``timeout`` passed first; raises when it failed.
    #[pyo3(signature = (req_id, timeout = None))]
    fn wait_admitted(
        &self,
        py: Python<'_>,
        req_id: String,
        timeout: Option<f64>,
    ) -> PyResult<bool> {
        let id = ReqId(req_id);
        let done = wait::interruptibly(
            py,
            wait::seconds(timeout)?,
            self.inner.handle().admitted(&id),
        )?;
        match done {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(f)) => Err(errors::send_failure(&f)),
        }
    }

    /// Awaitable ``wait_admitted``: returns once the receiver admitted ``req_id``; raises
    /// why it failed. Unbounded: bound it with ``asyncio.timeout``/``wait_for``.
    fn admitted<'py>(slf: &Bound<'py, Self>, req_id: String) -> PyResult<Bound<'py, PyAny>> {
        let me: Py<Self> = slf.clone().unbind();
        aio::spawn(slf.py(), async move {
            me.get()
                .inner
                .handle()
                .admitted(&ReqId(req_id))
                .await
                .map_err(|f| errors::send_failure(&f))
        })
    }

    /// Awaitable ``wait_outcome``: returns once ``req_id`` was delivered; raises why it
    /// failed. Unbounded: bound it with ``asyncio.timeout``/``wait_for``.
    fn outcome<'py>(slf: &Bound<'py, Self>, req_id: String) -> PyResult<Bound<'py, PyAny>> {
        let me: Py<Self> = slf.clone().unbind();
        aio::spawn(slf.py(), async move {
            me.get()
                .inner
                .handle()
                .outcome(&ReqId(req_id))
                .await
                .map_err(|f| errors::send_failure(&f))
        })
    }

    /// Takes a staging slot for ``req_id``, waiting at most ``timeout`` seconds (None: the
    /// sender's ``staging_timeout``); raises ``TimedOutError`` then. When no slot is free and
    /// only added, unsubmitted chunks hold staging (this request's or others'), they are
    /// submitted first, none as the last batch.
    #[pyo3(signature = (req_id, timeout = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        req_id: String,
        timeout: Option<f64>,
    ) -> PyResult<StagingSlot> {
        let id = ReqId(req_id.clone());
        let limit = match wait::seconds(timeout)? {
            Some(t) => t,
            None => self.inner.staging_timeout(),
        };
        // The common case first, with the GIL held: a free slot is taken under the sender's
        // lock in well under a microsecond, and releasing the GIL for it would hand the GIL
        // to another thread and queue this one behind it.
        let first = match self.inner.allocate(&id, Some(Duration::ZERO)) {
            Err(SendError::StagingTimedOut(_)) => None,
            other => Some(other),
        };
        let got = match first {
            Some(done) => Some(done),
            // One wait, bounded by `limit` in the core's driver.
            None => wait::interruptibly(py, None, self.inner.allocate_async(&id, Some(limit)))?,
        };
        match got {
            Some(Ok(guard)) => Ok(StagingSlot::new(guard, req_id, self.view(py))),
            Some(Err(e)) => Err(errors::send_error(&e)),
            None => Err(errors::send_error(&SendError::StagingTimedOut(limit))),
        }
    }

    /// Awaitable ``allocate``: a staging slot for ``req_id``, waiting at most ``timeout``
    /// seconds (None: ``staging_timeout``) without blocking the event loop. Cancelling the
    /// await hands back a slot it got.
    #[pyo3(signature = (req_id, timeout = None))]
    fn allocate_async<'py>(
        slf: &Bound<'py, Self>,
        req_id: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let id = ReqId(req_id.clone());
        let limit = wait::seconds(timeout)?.unwrap_or(me.inner.staging_timeout());
        let view = me.view(py);
        // A free slot is the common case: then the future is done before it is awaited.
        match me.inner.allocate(&id, Some(Duration::ZERO)) {
            Err(SendError::StagingTimedOut(_)) if !limit.is_zero() => {}
            got => {
                let slot = got.map_err(|e| errors::send_error(&e));
                return aio::done(
                    py,
                    slot.and_then(|g| StagingSlot::new(g, req_id, view).into_py_any(py)),
                );
            }
        }
        let me: Py<Self> = slf.clone().unbind();
        aio::spawn(py, async move {
            let guard = me
                .get()
                .inner
                .allocate_async(&id, Some(limit))
                .await
                .map_err(|e| errors::send_error(&e))?;
            Ok(StagingSlot::new(guard, req_id, view))
        })
    }

    /// Adds the chunk written into ``slot`` to its request's next batch: ``key`` names it to
    /// the receiver, ``nbytes`` is its length (None: the whole slot), ``tokens`` the tokens
    /// it covers. Its checksum is computed now: do not write the slot afterwards.
    #[pyo3(signature = (slot, key, *, nbytes = None, tokens = 0))]
    fn add(
        &self,
        py: Python<'_>,
        slot: &StagingSlot,
        key: String,
        nbytes: Option<usize>,
        tokens: u64,
    ) -> PyResult<()> {
        let guard = slot.take()?;
        let len = nbytes.unwrap_or(self.inner.handle().staging().slot_bytes());
        // The checksum reads the whole chunk: other Python threads run meanwhile.
        py.detach(|| self.inner.add(guard, key, len, tokens))
            .map_err(|e| errors::send_error(&e))
    }

    /// Submits ``req_id``'s added chunks as one batch; ``last=True`` ends the request (its
    /// declared chunks must all be in by then).
    #[pyo3(signature = (req_id, *, last = false))]
    fn submit(&self, req_id: String, last: bool) -> PyResult<()> {
        // Never waits (the batch is queued for the sender's task): the GIL stays held.
        self.inner
            .handle()
            .submit_added(&ReqId(req_id), last)
            .map_err(|e| errors::send_error(&e))
    }

    /// ``placement="caller"``: submits one batch of ``req_id``'s chunks read straight from
    /// the sender's staging (the program's own memory, where their bytes already are): chunk
    /// i is the whole of slot ``slots[i]``, named ``keys[i]`` to the receiver, covering
    /// ``tokens`` tokens; ``last=True`` ends the request. Each chunk's checksum is taken now.
    /// Do not change those slots until ``wait_released`` (or ``released``) returns for the
    /// request; several requests may name one slot at once. ``MisuseError`` on a sender that
    /// stages in kvx's pool, or for a slot out of range.
    #[pyo3(signature = (req_id, slots, keys, *, tokens = 0, last = false))]
    fn submit_slots(
        &self,
        py: Python<'_>,
        req_id: String,
        slots: Vec<u32>,
        keys: Vec<String>,
        tokens: u64,
        last: bool,
    ) -> PyResult<()> {
        if slots.len() != keys.len() {
            return Err(PyValueError::new_err(format!(
                "{} slots but {} keys: one key per chunk",
                slots.len(),
                keys.len()
            )));
        }
        let chunks = slots
            .into_iter()
            .zip(keys)
            .map(|(slot, key)| kvx_node::SlotChunk {
                slot: kvx_proto::StagingSlot(slot),
                key,
                tokens,
            })
            .collect();
        // The checksums read every chunk: other Python threads run meanwhile.
        py.detach(|| {
            self.inner
                .handle()
                .submit_slots(&ReqId(req_id), chunks, last)
        })
        .map_err(|e| errors::send_error(&e))
    }

    /// ``placement="caller"``: waits until ``req_id`` reads none of the program's staging
    /// any more: returns once it was delivered; raises why it failed, once its last posted
    /// write has completed (only then may the program change or free the slots it named);
    /// ``TimedOutError`` when ``timeout`` passed first. With kvx's own staging it is
    /// ``wait_outcome``.
    #[pyo3(signature = (req_id, timeout = None))]
    fn wait_released(&self, py: Python<'_>, req_id: String, timeout: Option<f64>) -> PyResult<()> {
        let id = ReqId(req_id.clone());
        let done = wait::interruptibly(
            py,
            wait::seconds(timeout)?,
            self.inner.handle().released(&id),
        )?;
        match done {
            Some(Ok(())) => Ok(()),
            Some(Err(f)) => Err(errors::send_failure(&f)),
            None => Err(errors::TimedOutError::new_err(format!(
                "request {req_id} still reads the sender's staging"
            ))),
        }
    }

    /// Awaitable ``wait_released``. Unbounded: bound it with ``asyncio.timeout``/``wait_for``.
    fn released<'py>(slf: &Bound<'py, Self>, req_id: String) -> PyResult<Bound<'py, PyAny>> {
        let me: Py<Self> = slf.clone().unbind();
        aio::spawn(slf.py(), async move {
            me.get()
                .inner
                .handle()
                .released(&ReqId(req_id))
                .await
                .map_err(|f| errors::send_failure(&f))
        })
    }

    /// Cancels ``req_id`` wherever it is; its staging and the receiver's slots are freed,
    /// and its end is ``CancelledError``.
    fn cancel(&self, req_id: String) -> PyResult<()> {
        self.inner
            .handle()
            .cancel(&ReqId(req_id))
            .map_err(|e| errors::send_error(&e))
    }

    /// Waits for ``req_id``'s end: returns when it was delivered, raises why it failed, or
    /// ``TimedOutError`` when ``timeout`` passed first.
    #[pyo3(signature = (req_id, timeout = None))]
    fn wait_outcome(&self, py: Python<'_>, req_id: String, timeout: Option<f64>) -> PyResult<()> {
        let id = ReqId(req_id.clone());
        let done = wait::interruptibly(
            py,
            wait::seconds(timeout)?,
            self.inner.handle().outcome(&id),
        )?;
        match done {
            Some(Ok(())) => Ok(()),
            Some(Err(f)) => Err(errors::send_failure(&f)),
            None => Err(errors::TimedOutError::new_err(format!(
                "request {req_id} has not ended yet"
            ))),
        }
    }

    /// Up to ``max`` request ends, as ``(req_id, error)`` pairs (``error`` None: delivered;
    /// else the exception saying why it failed), waiting at most ``timeout`` for the first;
    /// ``[]`` when none came. Each request's end comes once, to one caller.
    #[pyo3(signature = (max = 64, timeout = None))]
    fn next_ends(
        &self,
        py: Python<'_>,
        max: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<(String, Option<PyErr>)>> {
        let ends = wait::interruptibly(py, wait::seconds(timeout)?, self.inner.ends(max))?
            .unwrap_or_default();
        Ok(ends
            .into_iter()
            .map(|end| {
                (
                    end.req_id.0,
                    end.outcome.err().map(|f| errors::send_failure(&f)),
                )
            })
            .collect())
    }

    /// Staging slots free now (a snapshot).
    #[getter]
    fn staging_free(&self) -> u32 {
        self.inner.handle().staging_free()
    }

    /// ``(writes, bytes)``: fabric writes this sender posted so far and the bytes they
    /// carried. Chunks of one request whose staging slots and receiver slots are both
    /// consecutive (a run of KV blocks) go as one write over the TCP fabric, so
    /// ``writes`` counts runs there, chunks elsewhere.
    fn write_counts(&self) -> (u64, u64) {
        let counts = self.inner.handle().write_counts();
        (counts.writes, counts.bytes)
    }

    /// Staging slots in all.
    #[getter]
    fn slots(&self) -> u32 {
        self.inner.handle().staging().slots()
    }

    /// Bytes per staging slot.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.inner.handle().staging().slot_bytes()
    }

    /// The whole staging as a byte ``memoryview`` (with the shm fabric, of kvx's mapping).
    #[getter]
    fn staging(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.view.as_ref().map(|v| v.clone_ref(py))
    }

    /// Stops the sender; waits on running requests, and later calls, raise
    /// ``StoppedError``. Waits (at most
    /// ``timeout`` seconds, GIL released) until the notices already due to the proxy are
    /// written, so that a process exiting next does not lose them; returns whether they were.
    #[pyo3(signature = (timeout = 5.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let within = wait::seconds(Some(timeout))?.unwrap_or(Duration::from_secs(86_400));
        Ok(py.detach(|| self.inner.close(within)))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        py.detach(|| self.inner.close(CLOSE_WITHIN));
    }
}

impl Sender {
    /// The staging's byte view for a new slot, when the memory is Python's.
    fn view(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.view.as_ref().map(|v| v.clone_ref(py))
    }
}

impl StagingSlot {
    fn new(guard: StagingGuard, req_id: String, view: Option<Py<PyAny>>) -> Self {
        Self {
            index: guard.index(),
            guard: Mutex::new(Some(guard)),
            req_id,
            view,
        }
    }

    /// Runs `f` on the slot's bytes in place, with the GIL released.
    pub(crate) fn with_bytes(
        &self,
        py: Python<'_>,
        f: &mut (dyn FnMut(&mut [u8]) -> PyResult<()> + Send),
    ) -> PyResult<()> {
        let guard = self.guard.lock().unwrap_or_else(|p| p.into_inner());
        let Some(g) = guard.as_ref() else {
            return Err(errors::MisuseError::new_err(format!(
                "staging slot {} of request {} was already added or released",
                self.index, self.req_id
            )));
        };
        let mut result = Ok(());
        py.detach(|| g.with_slot(&mut |bytes| result = f(bytes)));
        result
    }

    fn take(&self) -> PyResult<StagingGuard> {
        self.guard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                errors::MisuseError::new_err(format!(
                    "staging slot {} of request {} was already added or released",
                    self.index, self.req_id
                ))
            })
    }

    fn with_guard<T>(&self, f: impl FnOnce(&StagingGuard) -> T) -> PyResult<T> {
        let guard = self.guard.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(g) => Ok(f(g)),
            None => Err(errors::MisuseError::new_err(format!(
                "staging slot {} of request {} was already added or released",
                self.index, self.req_id
            ))),
        }
    }
}

#[pymethods]
impl StagingSlot {
    /// The slot's index: bytes ``index × slot_bytes`` on of the staging.
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// The request it was taken for.
    #[getter]
    fn req_id(&self) -> &str {
        &self.req_id
    }

    /// The slot's bytes as a writable ``memoryview`` into the staging itself (zero-copy:
    /// ``numpy.frombuffer(slot.view, dtype)`` writes the bytes kvx sends).
    #[getter]
    fn view(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(view) = &self.view else {
            return Err(errors::MisuseError::new_err(
                "this sender's staging cannot be viewed from Python: use write()",
            ));
        };
        let slot_bytes = self.with_guard(|g| g.slot_bytes())?;
        Ok(memory::slot_view(py, view, self.index, slot_bytes)?.unbind())
    }

    /// Copies ``data`` (any bytes-like object) into the slot at ``offset``.
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let bytes = data
            .py()
            .import("builtins")?
            .getattr("bytes")?
            .call1((data,))?;
        let data = bytes.cast::<pyo3::types::PyBytes>()?.as_bytes();
        self.with_guard(|g| {
            let mut fits = false;
            g.with_slot(&mut |slot| {
                if let Some(dst) = offset
                    .checked_add(data.len())
                    .and_then(|end| slot.get_mut(offset..end))
                {
                    dst.copy_from_slice(data);
                    fits = true;
                }
            });
            fits
        })?
        .then_some(())
        .ok_or_else(|| PyValueError::new_err("the data does not fit the slot at that offset"))
    }

    /// Hands the slot back unused (as dropping it does).
    fn release(&self) {
        self.guard.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}
