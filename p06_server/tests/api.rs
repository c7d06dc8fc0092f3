//! Every endpoint over a real socket, against SmolLM2: the HTTP layer must
//! return exactly what the p05 engine generates, in OpenAI's shapes.

mod support;

include!("shared/api_cases.rs");
