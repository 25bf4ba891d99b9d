//! The OpenMP assist: copying a batch's logits rows to the branches and
//! scanning them (greedy winner, log-sum-exp) on llama.cpp's threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::metrics::{LogitStats, SUPER_BLOCK};
use crate::sync::lock;

/// Logits (all rows of a batch) up to which the log-sum-exps are summed in
/// the background after the reply; above, with the copy, before it. Small
/// batches stay in the CPU cache, so summing them later reads them again
/// cheaply, off the caller's path; large ones (Gemma 3 at 8 or 16 branches:
/// 8-16 MiB) would come from memory a second time, which cost more than
/// it saved (measured on the 2-core machine: no gain at 4 x 262k logits,
/// 0.2 ms more per step at 16 x 262k).
pub(super) const BACKGROUND_SUMS_UP_TO: usize = 1 << 20;

/// Each `SUPER_BLOCK` piece's greedy winner (an index into the piece), for
/// one row, piece by piece.
pub(super) type PieceWinners = Vec<Option<i32>>;

/// Copy each row of `sources` into `targets` and find its greedy winner,
/// spread over `threads` OpenMP threads; see `Worker::rows_logits`. The
/// unit of work is a `SUPER_BLOCK` piece of a row: copied and scanned for
/// its greedy winner while it is in the cache (one read of each row from
/// memory), and `with_sums` also summed for the log-sum-exp. Returns each
/// row's stats (the argmax only `with_argmax`; the log-sum-exp filled in
/// `with_sums`, else to come) and each piece's winner, row by row, piece by
/// piece, for [`log_sum_exps`].
pub(super) fn copy_and_scan(
    sources: &[&[f32]],
    targets: Vec<&mut [f32]>,
    with_argmax: &[bool],
    with_sums: bool,
    threads: u32,
) -> (Vec<LogitStats>, Vec<PieceWinners>) {
    // (row, start) of every piece, rows in order, pieces in order.
    let mut pieces: Vec<(usize, usize)> = Vec::new();
    let mut slots: Vec<Mutex<&mut [f32]>> = Vec::new();
    for (row, target) in targets.into_iter().enumerate() {
        for (k, slot) in target.chunks_mut(SUPER_BLOCK).enumerate() {
            pieces.push((row, k * SUPER_BLOCK));
            slots.push(Mutex::new(slot));
        }
    }
    type Found = (Option<i32>, Option<(f32, f64)>);
    let found: Vec<Mutex<Found>> = pieces.iter().map(|_| Mutex::new((None, None))).collect();
    crate::omp::for_each(pieces.len(), threads, &|i| {
        let (row, start) = pieces[i];
        let source = &sources[row][start..(start + SUPER_BLOCK).min(sources[row].len())];
        lock(&slots[i]).copy_from_slice(source);
        let winner = crate::sampling::greedy(source);
        let sum = if with_sums {
            crate::metrics::piece_sum(source, winner)
        } else {
            None
        };
        *lock(&found[i]) = (winner, sum);
    });
    let mut winners: Vec<PieceWinners> = vec![Vec::new(); sources.len()];
    let mut sums: Vec<Vec<Option<(f32, f64)>>> = vec![Vec::new(); sources.len()];
    for ((row, _), f) in pieces.iter().zip(found) {
        let (winner, sum) = f.into_inner().unwrap_or_else(|p| p.into_inner());
        winners[*row].push(winner);
        sums[*row].push(sum);
    }
    let stats = winners
        .iter()
        .enumerate()
        .map(|(row, w)| {
            // The largest winner, the earliest on ties (= greedy's choice).
            let best = w
                .iter()
                .enumerate()
                .filter_map(|(k, j)| {
                    j.map(|j| {
                        (
                            sources[row][k * SUPER_BLOCK + j as usize],
                            k * SUPER_BLOCK + j as usize,
                        )
                    })
                })
                .fold(None, |best, (v, i)| match best {
                    Some((bv, _)) if bv >= v => best,
                    _ => Some((v, i)),
                });
            let stats = LogitStats::new(
                best.filter(|_| with_argmax[row])
                    .and_then(|(_, i)| i32::try_from(i).ok()),
            );
            if with_sums {
                stats.fill(crate::metrics::combine_pieces(sums[row].iter().copied()));
            }
            stats
        })
        .collect();
    (stats, winners)
}

/// The work that completes `rows`' stats: the log-sum-exp of each
/// `(snapshot, stats, piece winners)`, one item per `SUPER_BLOCK` piece
/// (`metrics::piece_sum` against the piece's winner); whoever sums a row's
/// last piece combines the row in piece order (`metrics::combine_pieces`,
/// the same bits as `metrics::log_sum_exp`). Items may run on any threads
/// in any order. Returns the item count and the work.
pub(super) fn log_sum_exps(
    rows: Vec<(Arc<[f32]>, LogitStats, PieceWinners)>,
) -> (usize, Box<dyn Fn(usize) + Send + Sync>) {
    struct Row {
        logits: Arc<[f32]>,
        stats: LogitStats,
        winners: PieceWinners,
        sums: Vec<OnceLock<Option<(f32, f64)>>>,
        left: AtomicUsize,
    }
    let mut items: Vec<(usize, usize)> = Vec::new();
    let rows: Vec<Row> = rows
        .into_iter()
        .enumerate()
        .map(|(r, (logits, stats, winners))| {
            items.extend((0..winners.len()).map(|k| (r, k)));
            Row {
                sums: winners.iter().map(|_| OnceLock::new()).collect(),
                left: AtomicUsize::new(winners.len()),
                logits,
                stats,
                winners,
            }
        })
        .collect();
    for row in rows.iter().filter(|r| r.winners.is_empty()) {
        row.stats.fill(None); // an empty row has no finite logit
    }
    let n = items.len();
    let work = move |i: usize| {
        let (r, k) = items[i];
        let row = &rows[r];
        let start = k * SUPER_BLOCK;
        let piece = &row.logits[start..(start + SUPER_BLOCK).min(row.logits.len())];
        let _ = row.sums[k].set(crate::metrics::piece_sum(piece, row.winners[k]));
        if row.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            row.stats.fill(crate::metrics::combine_pieces(
                row.sums.iter().map(|s| s.get().copied().flatten()),
            ));
        }
    };
    (n, Box::new(work))
}

/// A buffer of `len` floats from `pool` that nobody else holds, or a new one.
pub(super) fn reuse(pool: &mut Vec<Arc<[f32]>>, len: usize) -> Arc<[f32]> {
    while let Some(mut buf) = pool.pop() {
        if Arc::get_mut(&mut buf).is_some_and(|b| b.len() == len) {
            return buf;
        }
    }
    Arc::from(vec![0f32; len])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919) % 1000) as f32 / 37.0 - 10.0)
            .collect()
    }

    #[test]
    pub(super) fn parallel_copy_and_stats_equal_one_sequential_pass() {
        let mut rows = [row(262_144, 3), row(49_152, 5), row(1000, 7), row(0, 0)];
        rows[1][40_000] = 1e3; // the winner in a later part
        rows[1][10] = 1e3; // ... tied with an earlier one: the earlier wins
        rows[2] = vec![f32::NAN; 1000]; // nothing finite
        for (threads, with_sums) in [1, 2, 4].into_iter().flat_map(|t| [(t, false), (t, true)]) {
            for n in 1..=rows.len() {
                let sources: Vec<&[f32]> = rows[..n].iter().map(Vec::as_slice).collect();
                let mut out: Vec<Vec<f32>> = sources.iter().map(|s| vec![0.0; s.len()]).collect();
                let targets: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                let (stats, winners) =
                    copy_and_scan(&sources, targets, &vec![true; n], with_sums, threads);
                if !with_sums {
                    // Nothing cached before the background pass: a reader
                    // would compute the value itself.
                    assert!(stats.iter().all(|s| s.cached_log_sum_exp().is_none()));
                    let (items, work) = log_sum_exps(
                        out.iter()
                            .zip(&stats)
                            .zip(winners)
                            .map(|((o, s), w)| (Arc::from(o.as_slice()), s.clone(), w))
                            .collect(),
                    );
                    crate::omp::Background::start(items, threads, work).finish();
                }
                for (i, s) in sources.iter().enumerate() {
                    assert_eq!(out[i].as_slice().len(), s.len());
                    assert!(out[i]
                        .iter()
                        .zip(*s)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                    let reference = LogitStats::of(s, true);
                    let what = format!("row {i}, {threads} threads, sums now: {with_sums}");
                    assert_eq!(stats[i].argmax(), reference.argmax(), "{what}");
                    assert_eq!(
                        stats[i].cached_log_sum_exp().map(|v| v.map(f64::to_bits)),
                        reference.cached_log_sum_exp().map(|v| v.map(f64::to_bits)),
                        "{what}"
                    );
                }
            }
        }
        let (stats, _) =
            copy_and_scan(&[&rows[1]], vec![&mut vec![0.0; 49_152]], &[true], false, 2);
        assert_eq!(stats[0].argmax(), Some(10));
    }

    #[test]
    pub(super) fn a_reader_before_the_background_pass_gets_the_same_bits() {
        let logits = row(49_152, 11);
        let (stats, winners) =
            copy_and_scan(&[&logits], vec![&mut vec![0.0; 49_152]], &[true], false, 2);
        let early = stats[0].surprisal(&logits, 5, crate::Base::Nats).unwrap();
        let (items, work) = log_sum_exps(vec![(
            Arc::from(logits.as_slice()),
            stats[0].clone(),
            winners[0].clone(),
        )]);
        crate::omp::Background::start(items, 2, work).finish();
        let late = stats[0].surprisal(&logits, 5, crate::Base::Nats).unwrap();
        assert_eq!(early.to_bits(), late.to_bits());
        assert_eq!(
            early.to_bits(),
            crate::metrics::surprisal(&logits, 5, crate::Base::Nats)
                .unwrap()
                .to_bits()
        );
    }
}
