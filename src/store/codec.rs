//! Value encoding: versioned JSON. Decode errors are errors, never panics.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::StoreError;

pub fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(v).map_err(|e| StoreError::Corrupt(format!("encode: {e}")))
}

pub fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(b)
        .map_err(|e| StoreError::Corrupt(format!("decode {}: {e}", std::any::type_name::<T>())))
}
