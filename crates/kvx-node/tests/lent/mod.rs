//! Memory a test lends kvx as an application's own (a model's per-layer KV tensors): layers
//! of bytes, each an `ExternalRegion`, joined end to end (`ExternalRegion::join`), read back
//! through the `Arc` the test keeps. Shared by the caller placement and caller staging tests.

use std::sync::Arc;

/// One layer's bytes.
pub struct Layer(Vec<std::cell::UnsafeCell<u8>>);

// SAFETY: the bytes are reached through the region (its locks) while kvx uses them, and by
// the test thread alone before (filling them) or after (reading them back).
unsafe impl Send for Layer {}
// SAFETY: as for `Send`.
unsafe impl Sync for Layer {}

impl Layer {
    pub fn zeroed(len: usize) -> Arc<Self> {
        Arc::new(Self(
            (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect(),
        ))
    }

    pub fn at(&self, i: usize) -> *mut u8 {
        self.0[i].get()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// `layers` lent as one region of `slot_bytes` slots, part after part.
pub fn region(layers: &[Arc<Layer>], slot_bytes: usize) -> kvx_io::ExternalRegion {
    let parts = layers
        .iter()
        .map(|layer| {
            // SAFETY: valid for the layer's length while its owner (an `Arc` clone) lives;
            // the tests touch it only before kvx uses it or after kvx is done with it.
            unsafe {
                kvx_io::ExternalRegion::new(
                    layer.at(0),
                    layer.len(),
                    slot_bytes,
                    Box::new(layer.clone()),
                )
            }
            .expect("a layer")
        })
        .collect();
    kvx_io::ExternalRegion::join(parts).expect("equal layers")
}
