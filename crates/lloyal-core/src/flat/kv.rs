//! KV cache operations of the flat API: remove, copy, keep, clear, save,
//! load and BlinkKV reseeding. Sequences leased by branches are off limits
//! here (branches manage their own KV).

use crate::engine::{Context, Job, Reply, Task, Worker};
use crate::error::{invalid, Error, Result};
use crate::kv;
use crate::sync::lock;

pub(crate) enum KvJob {
    Remove {
        seq: i32,
        start: i32,
        end: i32,
        reply: Reply<()>,
    },
    Copy {
        src: i32,
        dst: i32,
    },
    Keep {
        seq: i32,
    },
    Clear {
        reply: Reply<()>,
    },
    Save {
        seq: i32,
        tokens: Vec<i32>,
        reply: Reply<Vec<u8>>,
    },
    Load {
        seq: i32,
        data: Vec<u8>,
        reply: Reply<Vec<i32>>,
    },
    Reseed {
        seq: i32,
        sinks: Vec<i32>,
        tail: Vec<i32>,
        reply: Reply<()>,
    },
}

impl KvJob {
    pub(crate) fn fail(self, error: Error) {
        match self {
            KvJob::Copy { .. } | KvJob::Keep { .. } => {}
            KvJob::Remove { reply, .. } | KvJob::Clear { reply } | KvJob::Reseed { reply, .. } => {
                reply.send(Err(error))
            }
            KvJob::Save { reply, .. } => reply.send(Err(error)),
            KvJob::Load { reply, .. } => reply.send(Err(error)),
        }
    }
}

impl Task for KvJob {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        worker.execute_kv(*self);
    }

    fn fail(self: Box<Self>, error: Error) {
        KvJob::fail(*self, error);
    }
}

impl Context {
    /// A sequence id the flat API may touch: in range and not a branch's.
    fn flat_seq(&self, seq: i32) -> Result<()> {
        self.kv_seq_pos_max(seq)?;
        if lock(&self.shared.branches).is_leased(seq) {
            return Err(invalid(format!(
                "seq_id {seq} is leased by a branch; use the branch (or prune it) instead"
            )));
        }
        Ok(())
    }

    fn submit_kv(&self, job: KvJob) {
        self.submit(Job::task(job));
    }

    /// Tokens held by sequence `seq` (`kv_seq_pos_max + 1`).
    pub fn kv_cache_size(&self, seq: i32) -> Result<i32> {
        Ok(self.kv_seq_pos_max(seq)? + 1)
    }

    /// Remove positions `[start, end)` of `seq` (`end < 0`: to the end).
    pub fn kv_cache_remove(&self, seq: i32, start: i32, end: i32, reply: Reply<()>) {
        let checked = self.flat_seq(seq).and_then(|()| {
            if start < 0 || (end >= 0 && end < start) {
                return Err(invalid(format!("bad range [{start}, {end})")));
            }
            Ok(())
        });
        match checked {
            Ok(()) => self.submit_kv(KvJob::Remove {
                seq,
                start,
                end,
                reply,
            }),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Share `src`'s cells with `dst` (metadata only). Queued: it takes
    /// effect before any later operation on this context.
    pub fn kv_seq_copy(&self, src: i32, dst: i32) -> Result<()> {
        self.flat_seq(src)?;
        self.flat_seq(dst)?;
        self.submit_kv(KvJob::Copy { src, dst });
        Ok(())
    }

    /// Drop every cell not in `seq`. Queued like [`Context::kv_seq_copy`].
    /// Refused while branches hold KV (it would erase theirs).
    pub fn kv_seq_keep(&self, seq: i32) -> Result<()> {
        self.flat_seq(seq)?;
        self.no_branches()?;
        self.submit_kv(KvJob::Keep { seq });
        Ok(())
    }

    fn no_branches(&self) -> Result<()> {
        let branches = lock(&self.shared.branches);
        let live = branches.ids().len();
        if live > 0 {
            return Err(invalid(format!(
                "{live} branches hold KV cells; prune them first"
            )));
        }
        Ok(())
    }

    /// Clear every sequence. Refused while branches hold KV.
    pub fn kv_cache_clear(&self, reply: Reply<()>) {
        match self.check_open().and_then(|()| self.no_branches()) {
            Ok(()) => self.submit_kv(KvJob::Clear { reply }),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Serialise `seq` (with `tokens`, which you say it holds) to bytes.
    pub fn kv_cache_save(&self, seq: i32, tokens: Vec<i32>, reply: Reply<Vec<u8>>) {
        match self
            .flat_seq(seq)
            .and_then(|()| self.model().check_tokens(&tokens))
        {
            Ok(()) => self.submit_kv(KvJob::Save { seq, tokens, reply }),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Replace `seq` with a saved state; replies with the saved tokens.
    pub fn kv_cache_load(&self, seq: i32, data: Vec<u8>, reply: Reply<Vec<i32>>) {
        match self.flat_seq(seq) {
            Ok(()) => self.submit_kv(KvJob::Load { seq, data, reply }),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// BlinkKV: clear `seq`, then decode `sinks` and `tail` at contiguous
    /// positions from 0. The flat sampler's penalty history is untouched.
    pub fn clear_and_reseed(&self, seq: i32, sinks: Vec<i32>, tail: Vec<i32>, reply: Reply<()>) {
        let checked = self.flat_seq(seq).and_then(|()| {
            if sinks.is_empty() && tail.is_empty() {
                return Err(invalid("sinks and tail are both empty"));
            }
            self.model().check_tokens(&sinks)?;
            self.model().check_tokens(&tail)
        });
        match checked {
            Ok(()) => self.submit_kv(KvJob::Reseed {
                seq,
                sinks,
                tail,
                reply,
            }),
            Err(e) => reply.send(Err(e)),
        }
    }
}

impl Worker<'_> {
    pub(crate) fn execute_kv(&mut self, job: KvJob) {
        match job {
            KvJob::Remove {
                seq,
                start,
                end,
                reply,
            } => {
                let p1 = u32::try_from(end).ok();
                let result = self
                    .remove_cells(seq, u32::try_from(start).ok(), p1)
                    .map_err(|e| invalid(format!("could not remove [{start}, {end}): {e}")));
                self.refresh_all();
                reply.send(result);
            }
            KvJob::Copy { src, dst } => {
                let _ = self.ctx.copy_kv_cache_seq(src, dst, None, None);
                self.refresh_all();
            }
            KvJob::Keep { seq } => {
                match self.tomb() {
                    // Removed cells become tombstones, one sequence at a time.
                    Some(tomb) => {
                        for other in (0..tomb).filter(|&s| s != seq) {
                            let _ = self.remove_cells(other, None, None);
                        }
                    }
                    None => self.ctx.llama_kv_cache_seq_keep(seq),
                }
                self.refresh_all();
            }
            KvJob::Clear { reply } => {
                self.ctx.clear_kv_cache();
                self.refresh_all();
                reply.send(Ok(()));
            }
            KvJob::Save { seq, tokens, reply } => {
                let fp = kv::fingerprint(&self.model, &self.params);
                reply.send(kv::read_seq(&self.ctx, seq).map(|p| kv::encode(fp, &tokens, &p)));
            }
            KvJob::Load { seq, data, reply } => {
                let fp = kv::fingerprint(&self.model, &self.params);
                let result = kv::decode(fp, &data).and_then(|(tokens, payload)| {
                    self.model.check_tokens(&tokens)?;
                    kv::replace_seq(&mut self.ctx, seq, payload)?;
                    Ok(tokens)
                });
                self.refresh_all();
                reply.send(result);
            }
            KvJob::Reseed {
                seq,
                sinks,
                tail,
                reply,
            } => {
                let _ = self.remove_cells(seq, None, None);
                self.refresh_all();
                let mut tokens = sinks;
                tokens.extend(tail);
                reply.send(self.decode(&tokens, 0, seq));
            }
        }
    }
}
