//! `kvx.Receiver` and `kvx.ReadLease`: a decode worker's side, over `kvx_embed::Receiver`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kvx_embed::{ReadLease as Lease, ReceiverSettings};
use kvx_io::SlotMemory;
use kvx_proto::receiver::ChunkLayout;
use kvx_proto::{ReceiverConfig, SlotIndex};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::{aio, env, errors, memory, placement, runtime, wait};

/// A receiver: admits senders' requests into its buffer of ``slots × slot_bytes`` and hands
/// each complete request to the decoder.
///
/// ``Receiver(*, slots, slot_bytes, buffer=None, transport="zmq", fabric="tcp",
/// alloc="tcp://127.0.0.1:0", fabric_endpoint="tcp://127.0.0.1:0", peer_share_percent=None,
/// admission_timeout=None, unconsumed_ttl=None, require_checksums=None,
/// curve_secret_key=None, curve_allow=None, placement="pool", request_idle_timeout=None)``
///
/// A protocol setting given as ``None`` is kvx's default, the one ``kvx receiver`` runs with
/// (``kvx.defaults()["receiver"]``: a 75 % share, 30 s admission timeout, 300 s unconsumed
/// TTL, checksums required).
///
/// ``buffer``: the memory chunks land in, a writable contiguous buffer the receiver keeps
/// alive (``None``: a fresh ``bytearray``; the ``shm`` fabric allocates its own, which
/// ``Receiver.buffer`` and the lease's views then view), or a list of such buffers of the same
/// size (a model's per-layer KV tensors), each holding ``slots / len(buffer)`` slots: slot
/// ``p * (slots // len(buffer)) + i`` is slot i of part p. Read a
/// slot only while its request is leased (``next_ready`` → ``ReadLease.consume``).
/// ``peer_share_percent``: the most of the buffer one sender may hold, in percent (1-100).
/// ``require_checksums``: a kvx sender's chunk without a checksum fails its request; turn off
/// only for senders that cannot send one.
/// ``curve_secret_key``, ``curve_allow``: CURVE on the alloc channel (both or neither): this
/// receiver's secret certificate (``NAME.key_secret``) and the directory of the public
/// certificates of the senders allowed to connect (``docs/operations.md``, "CURVE").
/// ``placement``: ``"pool"`` (kvx's admission places each request in free slots) or
/// ``"caller"``: the program owns the buffer's slots, as a vLLM decode engine owns its KV
/// blocks, and lends each request's with ``reserve``; ``returned`` says when they are its
/// own again (``docs/spec/protocol.md``, "Caller placement").
#[pyclass(module = "kvx", frozen)]
pub(crate) struct Receiver {
    inner: kvx_embed::Receiver,
    views: Option<memory::Views>,
}

/// A ready request, leased: its slots stay put until ``consume`` (or the lease is dropped,
/// or its ``with`` block ends). Read its chunks through ``views()`` (zero-copy) or ``read``.
#[pyclass(module = "kvx", frozen)]
pub(crate) struct ReadLease {
    lease: Mutex<Option<Lease>>,
    req_id: String,
    slots: Vec<u32>,
    keys: Vec<String>,
    layout: ChunkLayout,
    tokens: Vec<Option<u64>>,
    slot_bytes: usize,
    views: Option<memory::Views>,
}

#[pymethods]
impl Receiver {
    #[new]
    #[pyo3(signature = (*, slots, slot_bytes, buffer = None, transport = "zmq", fabric = "tcp",
        alloc = "tcp://127.0.0.1:0", fabric_endpoint = "tcp://127.0.0.1:0",
        peer_share_percent = None, admission_timeout = None, unconsumed_ttl = None,
        require_checksums = None, curve_secret_key = None, curve_allow = None,
        placement = "pool", request_idle_timeout = None, heartbeat_interval = None, heartbeat_timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        slots: u32,
        slot_bytes: usize,
        buffer: Option<&Bound<'_, PyAny>>,
        transport: &str,
        fabric: &str,
        alloc: &str,
        fabric_endpoint: &str,
        peer_share_percent: Option<u32>,
        admission_timeout: Option<f64>,
        unconsumed_ttl: Option<f64>,
        require_checksums: Option<bool>,
        curve_secret_key: Option<PathBuf>,
        curve_allow: Option<PathBuf>,
        placement: &str,
        request_idle_timeout: Option<f64>,
        heartbeat_interval: Option<f64>,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let placement = placement::named(placement)?;
        let curve = env::curve_server(curve_secret_key, curve_allow)?;
        let heartbeats = env::Heartbeats {
            interval: heartbeat_interval,
            timeout: heartbeat_timeout,
        };
        let choice = env::choice(transport, fabric, curve, heartbeats)?;
        let own = env::needs_own_mapping(&choice);
        let in_parts = match buffer {
            Some(b) if b.is_instance_of::<PyList>() || b.is_instance_of::<PyTuple>() => {
                if own {
                    return Err(PyValueError::new_err(
                        "the shm fabric allocates its own buffer: it cannot take one in parts",
                    ));
                }
                Some(memory::lend_parts(py, b, slots, slot_bytes)?)
            }
            _ => None,
        };
        let (memory, view, part_views) = match in_parts {
            Some((memory, views)) => (memory, None, Some(views)),
            None => {
                let (memory, view) = memory::choose(py, buffer, slots, slot_bytes, own)?;
                (memory, view, None)
            }
        };
        let core = ReceiverConfig::default();
        let config = ReceiverConfig {
            buffer_slots: slots,
            peer_share_percent: peer_share_percent.unwrap_or(core.peer_share_percent),
            admission_timeout: match admission_timeout {
                Some(s) => wait::positive_seconds(s, "admission_timeout")?,
                None => core.admission_timeout,
            },
            unconsumed_ttl: match unconsumed_ttl {
                Some(s) => wait::positive_seconds(s, "unconsumed_ttl")?,
                None => core.unconsumed_ttl,
            },
            request_idle_timeout: match request_idle_timeout {
                Some(s) => wait::positive_seconds(s, "request_idle_timeout")?,
                None => core.request_idle_timeout,
            },
            require_checksums: require_checksums.unwrap_or(core.require_checksums),
            placement,
            ..core
        };
        // Checked here, once: kvx's driver and core take it as it is.
        let config = config
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let settings = ReceiverSettings {
            env: choice,
            config,
            buffer: memory,
            alloc_endpoint: alloc.to_owned(),
            fabric_endpoint: fabric_endpoint.to_owned(),
        };
        let rt = runtime::get()?;
        let inner = py
            .detach(|| kvx_embed::Receiver::start(rt, settings))
            .map_err(|e| errors::embed(&e))?;
        let views = match part_views {
            Some(views) => Some(views),
            None => memory::view_once_started(py, view, || inner.memory_view())?
                .map(|view| memory::Views::one(view, slots)),
        };
        Ok(Self { inner, views })
    }

    /// The bound alloc endpoint (port 0 resolved): give it to senders' ``add_receiver``.
    #[getter]
    fn alloc_endpoint(&self) -> &str {
        self.inner.alloc_endpoint()
    }

    /// The bound fabric endpoint (port 0 resolved).
    #[getter]
    fn fabric_endpoint(&self) -> &str {
        self.inner.fabric_endpoint()
    }

    /// Up to ``max`` ready requests, leased, waiting at most ``timeout`` seconds for the first
    /// (None: as long as it takes); ``[]`` when none came. Ended requests' notices (consumed
    /// ones too) do not end the wait. ``StoppedError`` once the receiver has stopped.
    #[pyo3(signature = (max = 16, timeout = None))]
    fn next_ready(
        &self,
        py: Python<'_>,
        max: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<ReadLease>> {
        // A request that ended between its notice and its lease leases nothing: wait on.
        let first_leases = async {
            loop {
                match self.inner.ready(max).await {
                    Ok(got) if got.is_empty() && max > 0 => {}
                    got => return got,
                }
            }
        };
        let leases = wait::interruptibly(py, wait::seconds(timeout)?, first_leases)?
            .transpose()
            .map_err(|e| errors::embed(&e))?
            .unwrap_or_default();
        Ok(leases.into_iter().map(|l| self.lease(py, l)).collect())
    }

    /// Awaitable ``next_ready``: up to ``max`` ready requests, leased, once the first is
    /// ready (unbounded: bound it with ``asyncio.timeout``/``wait_for``); ``[]`` only when its
    /// one request ended before it was leased; ``StoppedError`` once the receiver has
    /// stopped. Cancelled, it loses nothing: leases it had taken go to the next
    /// ``ready``/``next_ready`` call.
    #[pyo3(signature = (max = 16))]
    fn ready<'py>(slf: &Bound<'py, Self>, max: usize) -> PyResult<Bound<'py, PyAny>> {
        let owner: Py<Self> = slf.clone().unbind();
        aio::spawn_delivery(slf.py(), async move {
            let leases = owner
                .get()
                .inner
                .ready(max)
                .await
                .map_err(|e| errors::embed(&e))?;
            Ok(aio::OnTheirWay {
                owner,
                items: leases,
                make: |owner: &Self, py, lease| owner.lease(py, lease).into_py_any(py),
                back: |owner: &Self, leases| owner.inner.give_back(leases),
            })
        })
    }

    /// The buffer's accounting now: ``capacity``, ``free``, ``held``,
    /// ``reserved_unallocated``, ``quarantined``, ``tracked_requests``,
    /// ``admission_queue_len``. ``TimedOutError`` when kvx's driver does not answer within
    /// ``timeout`` seconds, ``StoppedError`` when the receiver has stopped.
    #[pyo3(signature = (timeout = 5.0))]
    fn snapshot<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let timeout = wait::positive_seconds(timeout, "timeout")?;
        let snap = py
            .detach(|| self.inner.snapshot(timeout))
            .map_err(|e| errors::embed(&e))?;
        let d = PyDict::new(py);
        d.set_item("capacity", snap.capacity)?;
        d.set_item("free", snap.free)?;
        d.set_item("held", snap.held)?;
        d.set_item("reserved_unallocated", snap.reserved_unallocated)?;
        d.set_item("quarantined", snap.quarantined)?;
        d.set_item("tracked_requests", snap.tracked_requests)?;
        d.set_item("admission_queue_len", snap.admission_queue_len)?;
        Ok(d)
    }

    /// Caller placement: lends ``slots`` (chunk i goes to ``slots[i]``) to request
    /// ``req_id``; the first sender whose request has that id and carries ``claim_secret``
    /// claims them (one that came first waits for this). Hand ``claim_secret`` (16..=128
    /// printable ASCII bytes, drawn at random per reservation: ``kvx.new_claim_secret()``)
    /// to the one sender meant to claim it (``Sender.begin(..., claim_secret=...)``): the
    /// request id alone claims nothing. ``MisuseError`` with the reason, nothing changed,
    /// for an id reserved and not yet returned, a slot out of range, named twice or reserved
    /// for another request not yet returned, or a ``placement="pool"`` receiver;
    /// ``ValueError`` for a malformed secret; ``TimedOutError`` when kvx's driver does not
    /// answer within ``timeout`` seconds; ``StoppedError``. ``held``: the request's first
    /// ``held`` chunks are the program's already (a local prefix hit): its sender, which
    /// sends every chunk, is told they are sent, and chunk ``held + i`` goes to
    /// ``slots[i]``.
    #[pyo3(signature = (req_id, slots, timeout = 5.0, *, claim_secret, held = 0))]
    fn reserve(
        &self,
        py: Python<'_>,
        req_id: &str,
        slots: Vec<u32>,
        timeout: f64,
        claim_secret: String,
        held: u32,
    ) -> PyResult<()> {
        let timeout = wait::positive_seconds(timeout, "timeout")?;
        let secret = placement::claim_secret(claim_secret)?;
        let slots = slots.into_iter().map(SlotIndex).collect();
        py.detach(|| self.inner.reserve(req_id, held, slots, secret, timeout))
            .map_err(|e| errors::embed(&e))
    }

    /// Caller placement: takes reservation ``req_id`` back (the program aborted its
    /// request): its sender's request fails, and the slots come back through ``returned``
    /// once no write can land in them. ``MisuseError`` for an id not reserved (or already
    /// returned).
    #[pyo3(signature = (req_id, timeout = 5.0))]
    fn withdraw(&self, py: Python<'_>, req_id: &str, timeout: f64) -> PyResult<()> {
        let timeout = wait::positive_seconds(timeout, "timeout")?;
        py.detach(|| self.inner.withdraw(req_id, timeout))
            .map_err(|e| errors::embed(&e))
    }

    /// Caller placement: up to ``max`` reservations back with the program (``Returned``:
    /// its slots are the program's again, no write can land in them), waiting at most
    /// ``timeout`` seconds for the first (None: as long as it takes); ``[]`` when none came.
    /// ``StoppedError`` once the receiver has stopped and every return was taken.
    #[pyo3(signature = (max = 64, timeout = None))]
    fn returned(
        &self,
        py: Python<'_>,
        max: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<placement::Returned>> {
        let got = wait::interruptibly(py, wait::seconds(timeout)?, self.inner.returned(max))?
            .transpose()
            .map_err(|e| errors::embed(&e))?
            .unwrap_or_default();
        Ok(got.into_iter().map(placement::Returned::from).collect())
    }

    /// Awaitable ``returned``: up to ``max`` reservations back with the program, once the
    /// first has come (unbounded: bound it with ``asyncio.timeout``/``wait_for``);
    /// ``StoppedError`` once the receiver has stopped and every return was taken. Cancelled,
    /// it loses nothing: returns it had taken go to the next ``returned``/``returned_async``.
    #[pyo3(signature = (max = 64))]
    fn returned_async<'py>(slf: &Bound<'py, Self>, max: usize) -> PyResult<Bound<'py, PyAny>> {
        let owner: Py<Self> = slf.clone().unbind();
        aio::spawn_delivery(slf.py(), async move {
            let returns = owner
                .get()
                .inner
                .returned(max)
                .await
                .map_err(|e| errors::embed(&e))?;
            Ok(aio::OnTheirWay {
                owner,
                items: returns,
                make: |_: &Self, py, back| placement::Returned::from(back).into_py_any(py),
                back: |owner: &Self, returns| owner.inner.give_back_returns(returns),
            })
        })
    }

    /// Slots in the buffer.
    #[getter]
    fn slots(&self) -> u32 {
        self.inner.reader().memory().slots()
    }

    /// Bytes per slot.
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.inner.reader().memory().slot_bytes()
    }

    /// The whole buffer as a byte ``memoryview`` (with the shm fabric, of kvx's memory);
    /// None for a buffer lent in parts (each part is the caller's own object).
    #[getter]
    fn buffer(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.views.as_ref().and_then(|v| v.whole(py))
    }

    /// Stops the receiver: its ports close; leases still held can no longer be consumed
    /// (their slots go with the receiver).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.shutdown(Duration::from_secs(5)));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }
}

impl Receiver {
    fn lease(&self, py: Python<'_>, lease: Lease) -> ReadLease {
        ReadLease {
            req_id: lease.key().req_id.0.clone(),
            slots: lease.slots().iter().map(|s| s.0).collect(),
            keys: lease.chunk_keys().to_vec(),
            layout: lease.layout().clone(),
            tokens: lease.chunk_tokens().to_vec(),
            slot_bytes: self.inner.reader().memory().slot_bytes(),
            views: self.views.as_ref().map(|v| v.clone_ref(py)),
            lease: Mutex::new(Some(lease)),
        }
    }
}

impl ReadLease {
    /// The request's id.
    pub(crate) fn req_id_str(&self) -> &str {
        &self.req_id
    }

    /// Runs `f` on chunk `chunk`'s slot in place, with the GIL released.
    pub(crate) fn with_chunk_bytes<T: Send>(
        &self,
        py: Python<'_>,
        chunk: usize,
        f: &mut (dyn FnMut(&[u8]) -> PyResult<T> + Send),
    ) -> PyResult<T> {
        if chunk >= self.slots.len() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "chunk {chunk} of a request of {} chunks",
                self.slots.len()
            )));
        }
        let lease = self.lease.lock().unwrap_or_else(|p| p.into_inner());
        let Some(l) = lease.as_ref() else {
            return Err(errors::MisuseError::new_err(format!(
                "request {} was already consumed",
                self.req_id
            )));
        };
        let mut result = None;
        py.detach(|| l.with_chunk(chunk, &mut |bytes| result = Some(f(bytes))));
        result.unwrap_or_else(|| Err(errors::KvxError::new_err("the chunk was not read")))
    }

    fn with_lease<T>(&self, f: impl FnOnce(&Lease) -> T) -> PyResult<T> {
        let lease = self.lease.lock().unwrap_or_else(|p| p.into_inner());
        match lease.as_ref() {
            Some(l) => Ok(f(l)),
            None => Err(errors::MisuseError::new_err(format!(
                "request {} was already consumed",
                self.req_id
            ))),
        }
    }
}

#[pymethods]
impl ReadLease {
    /// The request's id.
    #[getter]
    fn req_id(&self) -> &str {
        &self.req_id
    }

    /// Its slots, one per chunk in chunk order.
    #[getter]
    fn slots(&self) -> Vec<u32> {
        self.slots.clone()
    }

    /// The sender's key of each chunk, parallel to ``slots``.
    #[getter]
    fn keys(&self) -> Vec<String> {
        self.keys.clone()
    }

    /// The shape of one full chunk, as the sender described it (LMCache: ``[2, layers,
    /// tokens, head_size]``).
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.layout.shape.clone()
    }

    /// The chunks' torch dtype name, as the sender described it (e.g. ``"bfloat16"``).
    #[getter]
    fn dtype(&self) -> &str {
        &self.layout.dtype
    }

    /// The chunks' LMCache ``MemoryFormat`` value (``KV_2LTD`` = 1).
    #[getter]
    fn fmt(&self) -> u32 {
        self.layout.fmt
    }

    /// Each chunk's token count where its batch named it (the last chunk of each batch:
    /// LMCache's ``last_chunk_toks``), None for a full chunk of ``shape``; parallel to
    /// ``slots``.
    #[getter]
    fn tokens(&self) -> Vec<Option<u64>> {
        self.tokens.clone()
    }

    /// Each chunk's slot as a ``memoryview`` into the buffer itself (zero-copy), in chunk
    /// order. Valid until ``consume``: after it the slot may hold another request's bytes.
    fn views(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        self.with_lease(|_| ())?;
        let Some(views) = &self.views else {
            return Err(errors::MisuseError::new_err(
                "this receiver's buffer cannot be viewed from Python: use read()",
            ));
        };
        self.slots
            .iter()
            .map(|&slot| Ok(views.slot(py, slot, self.slot_bytes)?.unbind()))
            .collect()
    }

    /// A copy of chunk ``chunk``'s first ``nbytes`` bytes (None: the whole slot).
    #[pyo3(signature = (chunk, nbytes = None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        chunk: usize,
        nbytes: Option<usize>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        if chunk >= self.slots.len() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "chunk {chunk} of a request of {} chunks",
                self.slots.len()
            )));
        }
        let len = nbytes.unwrap_or(self.slot_bytes).min(self.slot_bytes);
        let mut out = Vec::new();
        self.with_lease(|l| l.with_chunk(chunk, &mut |b| out = b[..len].to_vec()))?;
        Ok(pyo3::types::PyBytes::new(py, &out))
    }

    /// Releases the request's slots for other requests, waiting at most ``timeout`` seconds
    /// for kvx's driver to confirm; ``wait=False`` hands the release to the driver and
    /// returns at once, unconfirmed (it can fail only when the receiver stopped, which frees
    /// everything anyway). Raises ``MisuseError`` when it was consumed already,
    /// ``StoppedError`` when the receiver has stopped.
    #[pyo3(signature = (timeout = 10.0, *, wait = true))]
    fn consume(&self, py: Python<'_>, timeout: f64, wait: bool) -> PyResult<()> {
        let timeout = wait::positive_seconds(timeout, "timeout")?;
        let lease = self
            .lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                errors::MisuseError::new_err(format!(
                    "request {} was already consumed",
                    self.req_id
                ))
            })?;
        if !wait {
            // A lease dropped unconsumed queues its release for the driver at once.
            drop(lease);
            return Ok(());
        }
        py.detach(|| lease.consume(timeout))
            .map_err(|e| errors::embed(&e))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        let lease = self.lease.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(lease) = lease {
            py.detach(|| lease.consume(Duration::from_secs(10)))
                .map_err(|e| errors::embed(&e))?;
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.slots.len()
    }
}
