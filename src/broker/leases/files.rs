//! File operations and artifacts on a lease's sandbox: read, write, list,
//! stat, mkdir, remove, move, upload and download.

use super::*;

impl Broker {
    /// File operations: read, write, list, stat, mkdir, remove, move.
    pub async fn file_op(
        &self,
        p: &Principal,
        ctx: &Ctx,
        lease_ref: &str,
        op: FileOp,
    ) -> Result<dto::FileAnswer> {
        let (action, scope, path) = match &op {
            FileOp::Read { path } => (Action::Read, "file:read", path),
            FileOp::Write { path, .. } => (Action::Write, "file:write", path),
            FileOp::List { path } => (Action::List, "file:list", path),
            FileOp::Stat { path } => (Action::Stat, "file:stat", path),
            FileOp::Mkdir { path } => (Action::Mkdir, "file:mkdir", path),
            FileOp::Remove { path } => (Action::Remove, "file:remove", path),
            FileOp::Move { path, .. } => (Action::Move, "file:move", path),
            FileOp::Upload { path, .. } => (Action::ArtifactUpload, "artifact:upload", path),
            FileOp::Download { path } => (Action::ArtifactDownload, "artifact:download", path),
        };
        let path = self.checked_path(p, ctx, &action, path).await?;
        let dest = match &op {
            FileOp::Move { destination, .. } => {
                Some(self.checked_path(p, ctx, &action, destination).await?)
            }
            _ => None,
        };
        if let FileOp::Write { content, .. } = &op
            && content.len() > MAX_WRITE
        {
            return Err(Error::new(
                Code::ValueTooLarge,
                format!("content is larger than {MAX_WRITE} bytes"),
            ));
        }
        let upload = match &op {
            FileOp::Upload { content_base64, .. } => {
                if content_base64.len() > MAX_ARTIFACT / 3 * 4 + 16 {
                    return Err(Error::new(
                        Code::ArtifactTooLarge,
                        format!("artifacts are limited to {MAX_ARTIFACT} bytes"),
                    ));
                }
                let b = B64.decode(content_base64.as_bytes()).map_err(|_| {
                    Error::new(Code::InvalidBase64, "content_base64 is not valid base64")
                })?;
                if b.len() > MAX_ARTIFACT {
                    return Err(Error::new(
                        Code::ArtifactTooLarge,
                        format!("artifacts are limited to {MAX_ARTIFACT} bytes"),
                    ));
                }
                Some(b)
            }
            _ => None,
        };
        let j = &self.inner.journal;
        let pd = j.digest("path", path.as_bytes());
        let dd = dest.as_ref().map(|d| j.digest("path", d.as_bytes()));
        let content_sha = match (&op, &upload) {
            (FileOp::Write { content, .. }, _) => {
                Some(hex::encode(sha2::Sha256::digest(content.as_bytes())))
            }
            (_, Some(b)) => Some(hex::encode(sha2::Sha256::digest(b))),
            _ => None,
        };
        let path2 = path.clone();
        let dest2 = dest.clone();
        let request_id = ctx.request_id.clone();
        let (_, (result, _)) = self
            .effect(
                p,
                ctx,
                lease_ref,
                action,
                scope,
                |e| {
                    e.path_digest = Some(pd);
                    e.destination_digest = dd;
                    e.content_sha256 = content_sha;
                },
                move |b: Broker, l: Lease, addr| async move {
                    let c = addr.cube.clone();
                    let (executor, sandbox_ref) = (b.executor(&l.backend), l.sandbox_ref);
                    let nf = |e: crate::cube::CubeError, code: Code| match e.kind {
                        ErrorKind::NotFound => Error::new(code, "no such file or directory"),
                        ErrorKind::InvalidArgument => Error::new(
                            Code::InvalidPath,
                            "the path is not usable for this operation",
                        ),
                        ErrorKind::Conflict => {
                            Error::new(Code::AlreadyExists, "the path already exists")
                        }
                        // The sandbox's own permissions (a read-only
                        // directory, a file of another user): the path's
                        // fault, not the backend's.
                        ErrorKind::Denied => Error::new(
                            Code::PathDenied,
                            "permission denied in the sandbox for this path",
                        ),
                        _ => backend(&e),
                    };
                    let r: (dto::FileAnswer, Option<u64>) = match op {
                        FileOp::Read { .. } => {
                            let st = c
                                .stat(&addr, &path2)
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            if st.is_dir() {
                                return Err(Error::new(
                                    Code::InvalidPath,
                                    "the path is a directory",
                                ));
                            }
                            // Only the first MAX_READ bytes are fetched, however large the file.
                            let (data, truncated) = c
                                .download_prefix(&addr, &path2, MAX_READ)
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            let n = data.len() as u64;
                            (
                                dto::FileAnswer::Read(dto::ReadResponse {
                                    content: String::from_utf8_lossy(&data).into_owned(),
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                    truncated,
                                }),
                                Some(n),
                            )
                        }
                        FileOp::Write { content, .. } => {
                            let n = content.len();
                            c.upload(&addr, &path2, content.into_bytes())
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            (
                                dto::FileAnswer::Write(dto::WriteResponse {
                                    bytes: n as u64,
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                }),
                                Some(n as u64),
                            )
                        }
                        FileOp::List { .. } => {
                            let entries = c
                                .list_dir(&addr, &path2, 1)
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            let entries = entries
                                .iter()
                                .take(MAX_LIST)
                                .map(dto::Entry::from)
                                .collect();
                            (
                                dto::FileAnswer::List(dto::ListResponse {
                                    entries,
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                }),
                                None,
                            )
                        }
                        FileOp::Stat { .. } | FileOp::Mkdir { .. } => {
                            let e = if matches!(op, FileOp::Stat { .. }) {
                                c.stat(&addr, &path2).await
                            } else {
                                c.make_dir(&addr, &path2).await
                            }
                            .map_err(|e| nf(e, Code::PathNotFound))?;
                            (
                                dto::FileAnswer::Entry(dto::EntryResponse {
                                    entry: dto::Entry::from(&e),
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                }),
                                None,
                            )
                        }
                        FileOp::Remove { .. } => {
                            c.remove(&addr, &path2)
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            (
                                dto::FileAnswer::Remove(dto::RemoveResponse {
                                    executor,
                                    path: path2,
                                    removed: true,
                                    request_id,
                                    sandbox_ref,
                                }),
                                None,
                            )
                        }
                        FileOp::Move { .. } => {
                            let d = dest2.unwrap_or_default();
                            let e = c
                                .rename(&addr, &path2, &d)
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            (
                                dto::FileAnswer::Move(dto::MoveResponse {
                                    destination: d,
                                    entry: dto::Entry::from(&e),
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                }),
                                None,
                            )
                        }
                        FileOp::Upload { .. } => {
                            let data = upload.unwrap_or_default();
                            let n = data.len();
                            let sha = hex::encode(sha2::Sha256::digest(&data));
                            c.upload(&addr, &path2, data)
                                .await
                                .map_err(|e| nf(e, Code::PathNotFound))?;
                            (
                                dto::FileAnswer::Upload(dto::UploadResponse {
                                    bytes: n as u64,
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                    sha256: sha,
                                }),
                                Some(n as u64),
                            )
                        }
                        FileOp::Download { .. } => {
                            let data = c.download(&addr, &path2, MAX_ARTIFACT).await.map_err(
                                |e| match e.kind {
                                    ErrorKind::TooLarge => Error::new(
                                        Code::ArtifactTooLarge,
                                        format!("artifacts are limited to {MAX_ARTIFACT} bytes"),
                                    ),
                                    _ => nf(e, Code::ArtifactNotFound),
                                },
                            )?;
                            let sha = hex::encode(sha2::Sha256::digest(&data));
                            let n = data.len() as u64;
                            (
                                dto::FileAnswer::Download(dto::DownloadResponse {
                                    bytes: n,
                                    content_base64: B64.encode(&data),
                                    executor,
                                    path: path2,
                                    request_id,
                                    sandbox_ref,
                                    sha256: sha,
                                }),
                                Some(n),
                            )
                        }
                    };
                    let bytes = r.1;
                    Ok(Done::new(r).bytes(bytes))
                },
            )
            .await?;
        Ok(result)
    }
}

/// A file operation.
#[derive(Debug, Clone)]
pub enum FileOp {
    Read {
        path: String,
    },
    Write {
        path: String,
        content: String,
    },
    List {
        path: String,
    },
    Stat {
        path: String,
    },
    Mkdir {
        path: String,
    },
    Remove {
        path: String,
    },
    Move {
        path: String,
        destination: String,
    },
    Upload {
        path: String,
        content_base64: String,
    },
    Download {
        path: String,
    },
}
