//! Handing a running sequence from one engine to another (Project 14's
//! prefill worker to its decode worker; a test's engine A to engine B).
//! What crosses: the tokens, the request's settings, the sampler's place
//! in its random stream, and the K/V of every token the model has seen.
//! The receiving core admits the sequence as running with those positions
//! computed, so its next step decodes the last sampled token exactly as
//! the first engine's next step would have.

use p05_kv_cache::generate::{GenerateParams, Sequence};
use p05_kv_cache::sampling::SamplerState;
use thiserror::Error;

use crate::core::{EngineCore, SeqData};
use crate::kv_backend::KvBackend;
use crate::kv_transfer::{KvBuffer, TransferError};
use crate::runner::{ModelRunner, RunnerError};
use crate::scheduler::SeqId;

/// A running sequence as another engine needs it to continue exactly:
/// its tokens, settings and sampler position, and the K/V of every token
/// but the last sampled one (the next step's input).
#[derive(Clone, Debug)]
pub struct SeqExport {
    pub prompt: Vec<u32>,
    /// Sampled so far (at least one).
    pub output: Vec<u32>,
    pub params: GenerateParams,
    pub sampler: SamplerState,
    pub salt: Vec<u8>,
    /// (prompt + output − 1) positions.
    pub kv: KvBuffer,
}

#[derive(Debug, Error)]
pub enum HandoffError {
    #[error("sequence {0} is not held here")]
    Unknown(SeqId),
    #[error("sequence {0} is already held here")]
    Duplicate(SeqId),
    #[error("sequence {0} has not sampled its first token yet")]
    NotStarted(SeqId),
    #[error("sequence {0} is not running with all but its last token computed (waiting, preempted or mid-prompt)")]
    NotCaughtUp(SeqId),
    #[error("sequence {0} is finished")]
    Finished(SeqId),
    #[error("the sequence's settings: {0}")]
    Request(String),
    #[error("the K/V buffer holds {got} positions; the tokens need {want}")]
    Tokens { got: usize, want: usize },
    #[error("sequence {id} needs up to {needs} K/V positions; the cache holds {capacity}")]
    TooLong {
        id: SeqId,
        needs: usize,
        capacity: usize,
    },
    /// No running slot or no free K/V now: try again after some finish.
    #[error("no room to run sequence {0} now")]
    Busy(SeqId),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error(transparent)]
    Runner(#[from] RunnerError),
}

impl<B: KvBackend, R: ModelRunner, C> EngineCore<'_, B, R, C> {
    /// A copy of running sequence `id`'s state (it keeps running here;
    /// abort it to hand it off). It must have sampled a token and have
    /// every earlier token's K/V.
    pub fn export(&mut self, id: SeqId) -> Result<SeqExport, HandoffError> {
        self.export_parts(id, true)
    }

    /// [`Self::export`] without copying the K/V (it left already, streamed
    /// while it was computed): the export's `kv` holds no positions.
    pub fn export_state(&mut self, id: SeqId) -> Result<SeqExport, HandoffError> {
        self.export_parts(id, false)
    }

    fn export_parts(&mut self, id: SeqId, with_kv: bool) -> Result<SeqExport, HandoffError> {
        let e = self.scheduler.find(id).ok_or(HandoffError::Unknown(id))?;
        let seq = &e.data.seq;
        if seq.is_finished() {
            return Err(HandoffError::Finished(id));
        }
        if seq.generated_tokens() == 0 {
            return Err(HandoffError::NotStarted(id));
        }
        if !self.scheduler.is_running(id) || e.computed + 1 != e.num_tokens {
            return Err(HandoffError::NotCaughtUp(id));
        }
        let (computed, prompt, output, params, sampler, salt) = (
            e.computed,
            seq.prompt().to_vec(),
            seq.output().to_vec(),
            seq.params().clone(),
            seq.sampler_state(),
            e.data.salt.clone(),
        );
        let kv = self.kv.seq_kv(id).ok_or(HandoffError::NotCaughtUp(id))?;
        self.flush_ops()?;
        let kv = match with_kv {
            true => self.runner.export_kv(id, &kv, computed)?,
            false => KvBuffer::zeros(self.runner.layout(), 0),
        };
        Ok(SeqExport {
            prompt,
            output,
            params,
            sampler,
            salt,
            kv,
        })
    }

    /// Run an exported sequence here as `id`, from its next decode step,
    /// with `client` as its stream. Refused (the client comes back) when
    /// the state does not fit this engine: layout, context, room.
    pub fn import(
        &mut self,
        id: SeqId,
        state: &SeqExport,
        client: C,
    ) -> Result<(), (HandoffError, C)> {
        match self.admit_imported(id, state) {
            Ok((seq, max_len)) => {
                let n = seq.history().len();
                let data = SeqData::new(seq, state.salt.clone(), client);
                self.scheduler
                    .add_running(id, n, n - 1, max_len, data)
                    .map_err(|data| {
                        self.kv.free(id);
                        (HandoffError::Busy(id), data.client)
                    })
            }
            Err(e) => Err((e, client)),
        }
    }

    /// The sequence `state` continues, checked against this engine: its
    /// most positions, and how many arrive computed.
    pub(crate) fn resume_state(
        &self,
        id: SeqId,
        state: &SeqExport,
    ) -> Result<(Sequence, usize, usize), HandoffError> {
        if self.is_held(id) {
            return Err(HandoffError::Duplicate(id));
        }
        if state.output.is_empty() {
            return Err(HandoffError::NotStarted(id));
        }
        let seq = Sequence::resume::<std::convert::Infallible>(
            &self.info,
            &state.prompt,
            &state.output,
            &state.params,
            state.sampler,
            self.tok,
        )
        .map_err(|e| HandoffError::Request(e.to_string()))?;
        if seq.is_finished() || seq.output().len() != state.output.len() {
            return Err(HandoffError::Finished(id));
        }
        let computed = seq.history().len() - 1;
        let max_len = state.prompt.len().saturating_add(state.params.max_tokens);
        self.check_fits(id, max_len)?;
        Ok((seq, max_len, computed))
    }

    pub(crate) fn check_fits(&self, id: SeqId, max_len: usize) -> Result<(), HandoffError> {
        let capacity = self.kv.capacity_positions();
        if max_len > capacity {
            return Err(HandoffError::TooLong {
                id,
                needs: max_len,
                capacity,
            });
        }
        Ok(())
    }

    /// Check the state, allocate its K/V and write it; the sequence and its
    /// most positions.
    fn admit_imported(
        &mut self,
        id: SeqId,
        state: &SeqExport,
    ) -> Result<(Sequence, usize), HandoffError> {
        if self.reserved.contains_key(&id) {
            return Err(HandoffError::Duplicate(id));
        }
        let (seq, max_len, computed) = self.resume_state(id, state)?;
        let history = seq.history();
        if state.kv.tokens != computed {
            return Err(HandoffError::Tokens {
                got: state.kv.tokens,
                want: computed,
            });
        }
        state.kv.check(&self.runner.layout())?;
        if !self.scheduler.has_running_room() {
            return Err(HandoffError::Busy(id));
        }
        if !self.kv.admit_computed(id, &history[..computed], max_len) {
            return Err(HandoffError::Busy(id));
        }
        let written = self.flush_ops().and_then(|()| {
            let kv = self.kv.seq_kv(id).ok_or(HandoffError::Busy(id))?;
            Ok(self.runner.import_kv(id, &kv, &state.kv)?)
        });
        if let Err(e) = written {
            self.kv.free(id);
            return Err(e);
        }
        self.kv.commit(id, history, &state.salt, computed);
        Ok((seq, max_len))
    }

    /// Storage work recorded since the last step, done now (before K/V is
    /// read or written outside a step).
    pub(crate) fn flush_ops(&mut self) -> Result<(), HandoffError> {
        let mut ops = Vec::new();
        self.kv.take_ops(&mut ops);
        if !ops.is_empty() {
            self.runner.apply(&ops)?;
        }
        Ok(())
    }
}
