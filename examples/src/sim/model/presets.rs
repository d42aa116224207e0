//! Named model/GPU pairs for the engine model, each coefficient from a published profile or fit,
//! or derived from published figures where none is measured (said below and in
//! docs/sim-engine.md). Sources: DistServe (OSDI'24) fits; Vidur's profiles (MLSys'24); the
//! Mooncake paper (FAST'25) FLOP formula; the GPUs' data sheets (HBM bandwidth, dense bf16
//! FLOP/s). Derivations use η = 0.7 of HBM bandwidth for decode and 60% of dense FLOP/s for
//! attention, and a KV capacity of 90% of HBM less the weights.

use clap::ValueEnum;

use super::{Coefficients, DEFAULT_TOKEN_BUDGET};

/// A model on a GPU (one data-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// OPT-13B, TP1, A100-80G: DistServe's own fits of prefill and decode time (measured).
    #[value(name = "opt-13b-a100")]
    Opt13bA100,
    /// Llama-2-7B, TP1, H100: Vidur's linear prefill and weights-read profiles.
    #[value(name = "llama2-7b-h100")]
    Llama2_7bH100,
    /// Llama-2-7B, TP1, A100-80G: Vidur's profiles.
    #[value(name = "llama2-7b-a100")]
    Llama2_7bA100,
    /// Llama-3-8B, TP1, A100-80G: Vidur's prefill profile; decode from bandwidth.
    #[value(name = "llama3-8b-a100")]
    Llama3_8bA100,
    /// Llama-3-8B, TP1, H100: Vidur's H100 profile scaled by parameters; decode from bandwidth.
    #[value(name = "llama3-8b-h100")]
    Llama3_8bH100,
    /// Llama-3-8B, TP1, H200: as on H100 (same compute), H200's 4.8 TB/s and 141 GB.
    #[value(name = "llama3-8b-h200")]
    Llama3_8bH200,
    /// Llama-3-70B, TP8 on 8×A800, as the Mooncake paper ran: its FLOP formula.
    #[value(name = "llama3-70b-tp8-a800")]
    Llama3_70bTp8A800,
}

impl Preset {
    /// The preset's coefficients.
    pub fn coefficients(self) -> Coefficients {
        let base = Coefficients {
            c0_ms: 0.0,
            k_lin_ms: 0.0,
            k_att_ms: 0.0,
            w_ms: 0.0,
            ctx_ms: 0.0,
            c_ms: 0.05,
            token_budget: DEFAULT_TOKEN_BUDGET,
            kv_capacity_tokens: 0,
        };
        match self {
            // DistServe: prefill 18.10 + 0.1019·Σl + 7.12e-6·Σl² ms, decode 19.93 +
            // 6.27e-4·Σctx + 0.0385·B ms; KV 800 KiB a token, 46 GB free on 80 GB.
            Preset::Opt13bA100 => Coefficients {
                c0_ms: 18.10,
                k_lin_ms: 0.1019,
                k_att_ms: 7.12e-6,
                w_ms: 19.93,
                ctx_ms: 6.27e-4,
                c_ms: 0.0385,
                kv_capacity_tokens: 56_000,
                ..base
            },
            // Vidur: 1.4 ms + 20.8 µs/token, weights read 5.6 ms; attention 2·n²·d·l FLOPs at
            // 60% of 989 TFLOP/s; KV 512 KiB a token at 0.7 × 3.35 TB/s, 58.5 GB free.
            Preset::Llama2_7bH100 => Coefficients {
                c0_ms: 1.4,
                k_lin_ms: 0.0208,
                k_att_ms: 4.4e-7,
                w_ms: 5.6,
                ctx_ms: 2.236e-4,
                kv_capacity_tokens: 111_000,
                ..base
            },
            // Vidur: 2.0 ms + 64.3 µs/token, weights read 9.5 ms (9.3-9.7); attention at 312
            // TFLOP/s; 0.7 × 2.0 TB/s.
            Preset::Llama2_7bA100 => Coefficients {
                c0_ms: 2.0,
                k_lin_ms: 0.0643,
                k_att_ms: 1.39e-6,
                w_ms: 9.5,
                ctx_ms: 3.745e-4,
                kv_capacity_tokens: 111_000,
                ..base
            },
            // Vidur: 8.8 ms + 66.1 µs/token; 16.06 GB of weights at 0.7 × 2.0 TB/s; KV 128 KiB
            // a token (GQA), 56 GB free.
            Preset::Llama3_8bA100 => Coefficients {
                c0_ms: 8.8,
                k_lin_ms: 0.0661,
                k_att_ms: 1.39e-6,
                w_ms: 11.5,
                ctx_ms: 9.36e-5,
                kv_capacity_tokens: 427_000,
                ..base
            },
            // Vidur's H100 linear term × 8.03/6.74 (parameters); 0.7 × 3.35 TB/s.
            Preset::Llama3_8bH100 => Coefficients {
                c0_ms: 1.4,
                k_lin_ms: 0.0248,
                k_att_ms: 4.4e-7,
                w_ms: 6.85,
                ctx_ms: 5.59e-5,
                kv_capacity_tokens: 427_000,
                ..base
            },
            // As on H100; weights read 4.8 ms, 0.7 × 4.8 TB/s, about 850k tokens of KV.
            Preset::Llama3_8bH200 => Coefficients {
                c0_ms: 1.4,
                k_lin_ms: 0.0248,
                k_att_ms: 4.4e-7,
                w_ms: 4.8,
                ctx_ms: 3.90e-5,
                kv_capacity_tokens: 850_000,
                ..base
            },
            // Mooncake: flops(n) = l·(4·n²·d + 22·n·d²), l = 80, d = 8192, at 60% of 8 × 312
            // TFLOP/s; 140 GB of weights at 0.7 × 8 × 2.0 TB/s (also the prefill's fixed cost);
            // KV 320 KiB a token, 436 GB free on 8 × 80 GB.
            Preset::Llama3_70bTp8A800 => Coefficients {
                c0_ms: 12.5,
                k_lin_ms: 0.0789,
                k_att_ms: 1.75e-6,
                w_ms: 12.5,
                ctx_ms: 2.93e-5,
                kv_capacity_tokens: 1_330_000,
                ..base
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_their_published_points() {
        // Vidur, Llama-2-7B on H100: 4096 tokens ≈ 83.6 ms of linear work (MLP); its own
        // linear fit is within 5% of that point.
        let h100 = Preset::Llama2_7bH100.coefficients();
        let linear = h100.c0_ms + h100.k_lin_ms * 4096.0;
        assert!((linear / 83.6 - 1.0).abs() < 0.05, "{linear}");
        // Vidur, Llama-3-8B on A100: 8192 tokens ≈ 546 ms of linear work.
        let a100 = Preset::Llama3_8bA100.coefficients();
        let linear = a100.c0_ms + a100.k_lin_ms * 8192.0;
        assert!((linear - 546.0).abs() < 5.0, "{linear}");
        // fleet.md: the attention term ≈ 30 ms at 8192 tokens for an 8B model on H100.
        let attention = h100.k_att_ms * 8192.0 * 8192.0;
        assert!((25.0..35.0).contains(&attention), "{attention}");
        for preset in Preset::value_variants() {
            let c = preset.coefficients();
            assert!(
                c.kv_capacity_tokens > 0 && c.w_ms > 0.0 && c.k_lin_ms > 0.0,
                "{preset:?}"
            );
        }
    }
}
