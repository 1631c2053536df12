//! Runs of writes (`kvx_io::WriteRun`) over `RdmaFabric` on the NIC model: RDMA does not
//! carry a run as one write, so it posts the pieces (`docs/spec/fabrics.md` §3 "Runs").

use kvx_io::{Fabric, SlotGeometry};

use crate::tests::{attach, completions, fabric, write, STEP};

/// A run (`kvx_io::WriteRun`) goes over RDMA as its pieces: a work request each, completed
/// in order and announced each for its own slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_goes_as_its_pieces() {
    let (f, _) = fabric();
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(8, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..8, 1);
    let conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    assert!(!conn.carries_runs(), "RDMA posts a run's pieces");
    let mut run = kvx_io::WriteRun::new(write(0, 4, 1));
    for i in 1..4 {
        run.push(write(i, 4 + i as u32, 1), 1024)
            .expect("consecutive slots");
    }
    let mut conn = conn;
    assert_eq!(conn.post_run(run).ok(), Some(4), "four writes");
    let out = completions(&mut conn, 4).await;
    assert_eq!(
        out,
        (0..4).map(|i| (i, Ok(()))).collect::<Vec<_>>(),
        "completions in posting order"
    );
    let mut slots = Vec::new();
    for _ in 0..4 {
        let landed = tokio::time::timeout(STEP, listener.landed.recv())
            .await
            .expect("a notice in time")
            .expect("listener open");
        slots.push(landed.slot.0);
    }
    assert_eq!(slots, vec![4, 5, 6, 7]);
}
